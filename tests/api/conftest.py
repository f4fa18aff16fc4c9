"""A real ``sessioncache serve`` process per test module, and httpx clients against it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.support.servers import Server, start_server

KEYS = {"key-acme": "acme", "key-globex": "globex"}
METRICS_TOKEN = "metrics-token-of-the-api-tests"
METRICS = {"authorization": f"Bearer {METRICS_TOKEN}"}
"""What a scrape of every tenant's series carries (``SESSIONCACHE_METRICS_TOKEN``)."""


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("open") / "data")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("auth") / "data",
        {"SESSIONCACHE_API_KEYS": json.dumps(KEYS)},
    )
    yield server
    server.stop()


@pytest.fixture
def client(open_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=open_server.url, timeout=30) as c:
        yield c
