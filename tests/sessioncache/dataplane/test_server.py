"""The stream server in this process, on a Unix-domain socket (the carrier the same-host path
will use): the listener is replaceable, ``stop`` ends every connection and releases its
leases, the connection limit answers BUSY, and without API keys only local peers get in."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from sessioncache.config import Settings
from sessioncache.connector import StreamClient
from sessioncache.dataplane.frames import Limits
from sessioncache.dataplane.server import StreamServer, open_stream_server
from sessioncache.dataplane.transport import UnixListener
from sessioncache.errors import AuthRefused, Busy, InvalidInput, StreamClosed
from sessioncache.factory import open_node
from sessioncache.node import CacheNode
from sessioncache.operations import caller as callers
from tests.sessioncache.dataplane.conftest import NS, pattern, tokens


@pytest.fixture
def node(tmp_path: Path) -> Iterator[CacheNode]:
    settings = Settings(data_dir=tmp_path / "data", cpu_bytes=32 << 20, disk_bytes=0)
    node = open_node(settings, start=False)
    yield node
    node.close()


def test_a_unix_socket_server_and_its_stop(node: CacheNode, tmp_path: Path):
    path = str(tmp_path / "stream.sock")
    server = StreamServer(node, UnixListener(path), max_connections=2).start()
    try:
        client = StreamClient.connect(f"unix:{path}")
        root = client.resolve(NS)
        toks = tokens(60, 8)
        ids = client.block_hashes(root, toks)
        ack = client.store(root, toks, [pattern(h, 4096) for h in ids])
        assert ack.stored == 8 and not ack.durable  # no durable tier here
        found = client.lookup(root, ids, lease_ms=60_000)
        out = np.zeros((8, 4096), np.uint8)
        client.load_into(found, list(out))
        assert all(np.array_equal(row, pattern(h, 4096)) for row, h in zip(out, ids, strict=True))
        assert node.store.stats().leases == 1

        second = StreamClient.connect(f"unix:{path}")
        with pytest.raises(Busy):
            StreamClient.connect(f"unix:{path}")
        second.close()
    finally:
        server.stop()
    # stopping ended the connection and released what it held
    assert node.store.stats().leases == 0
    assert server.connections() == 0
    with pytest.raises(StreamClosed):
        client.lookup(root, ids)
    assert not Path(path).exists()


def test_open_mode_admits_local_peers_only(node: CacheNode):
    callers.admit(node, local=True)
    with pytest.raises(AuthRefused, match="local peers only"):
        callers.admit(node, local=False)


def test_settings_build_the_server(node: CacheNode):
    assert (
        open_stream_server(node, node.settings.model_copy(update={"stream_enabled": False})) is None
    )
    settings = node.settings.model_copy(
        update={"stream_port": 0, "stream_advertise": "cache.example:9000", "stream_max_ids": 7}
    )
    server = open_stream_server(node, settings)
    assert server is not None
    try:
        assert server.advertise == "cache.example:9000"
        assert server.address.startswith("127.0.0.1:") and not server.address.endswith(":0")
        assert server.limits.max_ids == 7
        assert server.limits.max_block_bytes == settings.max_body_bytes
    finally:
        server.stop()


def test_the_client_splits_what_one_request_cannot_carry(node: CacheNode, tmp_path: Path):
    path = str(tmp_path / "small.sock")
    server = StreamServer(node, UnixListener(path), limits=Limits(max_ids=3)).start()
    try:
        with StreamClient.connect(f"unix:{path}") as client:
            assert client.limits.max_ids == 3
            root = client.resolve(NS)
            toks = tokens(61, 8)
            ids = client.block_hashes(root, toks)
            ack = client.store(root, toks, [pattern(h, 1024) for h in ids])  # three STOREs
            assert ack.hashes == ids and ack.stored == 8
            assert client.lookup(root, ids[:3]).matched == 3
            with pytest.raises(InvalidInput, match="3 at most"):
                client.lookup(root, ids)
            assert client.load(ids[5:8]) == [pattern(h, 1024).tobytes() for h in ids[5:8]]
    finally:
        server.stop()
