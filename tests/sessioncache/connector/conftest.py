"""Real ``sessioncache serve`` processes for the connector tests (tests/support/servers.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator

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
