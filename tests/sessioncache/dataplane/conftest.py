"""Real ``sessioncache serve`` processes for the data-plane tests: the node in its own process
(tests/support/servers.py, stream on a free port), the clients in the test process or in
child processes of it."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from sessioncache.connector import StreamClient, discover
from sessioncache.connector.samehost import SameHostClient
from sessioncache.dataplane import frames
from sessioncache.dataplane.frames import HEADER_SIZE, Header
from sessioncache.dataplane.samehost_server import open_samehost_server
from sessioncache.dataplane.server import StreamServer
from sessioncache.dataplane.transport import UnixListener
from sessioncache.hashing import Namespace
from sessioncache.node import CacheNode
from tests.support.servers import Server, start_server

KEYS = {"key-acme": "acme", "key-globex": "globex"}
NS = Namespace("stream-test-model", block_tokens=4, kv_dtype="bf16", kv_layout="x")
BLOCK = 64 << 10


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # LRU: the slot-reuse tests need churn, and under the default forecast blocks read a
    # moment ago are kept while new ones bypass the full tier (docs/sessions.md).
    server = start_server(
        tmp_path_factory.mktemp("stream-open") / "data", {"SESSIONCACHE_EVICTION_POLICY": "lru"}
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("stream-auth") / "data", {"SESSIONCACHE_API_KEYS": json.dumps(KEYS)}
    )
    yield server
    server.stop()


def connect(server: Server, key: str | None = None) -> StreamClient:
    return StreamClient.connect(discover(server.url, api_key=key), api_key=key, timeout=30)


def rest(server: Server, path: str, key: str | None = None) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    reply = httpx.get(f"{server.url}{path}", headers=headers, timeout=10)
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


def wait_until(condition: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def settled(server: Server, key: str | None = None) -> bool:
    """No lease left and no stream connection open."""
    return (
        rest(server, "/v1/stats", key)["leases"] == 0
        and rest(server, "/v1/dataplane", key)["connections"] == 0
    )


def tokens(seed: int, blocks: int, block_tokens: int = NS.block_tokens) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50_000, blocks * block_tokens).astype(np.uint32)


def pattern(block_id: bytes, size: int = BLOCK) -> np.ndarray:
    """A block's payload, a function of its id: any byte from another block shows."""
    return np.frombuffer(block_id * (size // 16), np.uint8).copy()


# -- raw peers (the frame codec over a plain socket) -----------------------------------------


def raw_connect(server: Server, key: str | None = None) -> socket.socket:
    host, _, port = discover(server.url, api_key=key).rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def read_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"{n - len(buf)} bytes short")
        buf += chunk
    return bytes(buf)


def read_frame(sock: socket.socket) -> tuple[Header, bytes]:
    header = frames.decode_header(read_exactly(sock, HEADER_SIZE), requests=False)
    return header, read_exactly(sock, header.body_len)


def raw_hello(sock: socket.socket, key: str | None = None) -> frames.HelloOk:
    sock.sendall(frames.encode_hello(1, frames.Hello(key, "raw")))
    header, body = read_frame(sock)
    assert header.opcode == frames.Op.HELLO_OK, body
    return frames.decode_hello_ok(body)


def assert_closed(sock: socket.socket) -> None:
    """The node closed the connection (after whatever it had sent)."""
    sock.settimeout(10)
    with contextlib.suppress(ConnectionResetError):
        assert sock.recv(1) == b""


@pytest.fixture
def stream(node: CacheNode, tmp_path: Path) -> Iterator[StreamClient]:
    """A stream client of an in-process server over the test module's ``node``."""
    path = str(tmp_path / "stream.sock")
    server = StreamServer(node, UnixListener(path)).start()
    client = StreamClient.connect(f"unix:{path}")
    yield client
    client.close()
    server.stop()


@pytest.fixture
def samehost(node: CacheNode) -> Iterator[SameHostClient]:
    """A same-host client of an in-process server over the test module's ``node``."""
    server = open_samehost_server(node, node.settings)
    if server is None:
        pytest.skip("no shared-memory CPU tier on this platform")
    server.start()
    client = SameHostClient.connect(server.address)
    yield client
    client.close()
    server.stop()
