"""Real ``sessioncache serve`` processes for the connector tests (tests/support/servers.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest

from sessioncache.hashing import Namespace
from tests.support.servers import Server, start_server

API_KEYS = {"k": "t"}
NS = Namespace("connector-test-model", block_tokens=8, kv_dtype="float32", kv_layout="raw")


@pytest.fixture(scope="session")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("connector-open") / "data")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("connector-auth") / "data",
        {"SESSIONCACHE_API_KEYS": json.dumps(API_KEYS)},
    )
    yield server
    server.stop()


def received_bytes(server: Server, carrier: str) -> int:
    """Block payload bytes the node has received over ``carrier`` (``stream``, ``same_host``,
    ``rest``): its ``sessioncache_received_payload_bytes_total``."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    series = rf'^sessioncache_received_payload_bytes_total\{{carrier="{carrier}"\}} (\S+)$'
    found = re.search(series, text, re.M)
    assert found is not None, f"no received payload bytes of {carrier} in /metrics"
    return int(float(found.group(1)))
