"""Declined lookups on the data plane (version 4, ``F_LOOKUP_DECLINED``): over the stream and
the same-host socket the node matches nothing, leases and touches nothing, and counts the
tokens it holds as the session's ``declined`` misses; another tenant's declined lookup learns
and counts nothing; a connection of version 3 neither sends nor takes one."""

from __future__ import annotations

import socket
import struct

import numpy as np
import pytest

from sessioncache.connector import StreamClient, ops
from sessioncache.dataplane import frames
from sessioncache.dataplane.frames import HEADER_SIZE, Op
from sessioncache.dataplane.server import StreamServer
from sessioncache.dataplane.transport import TcpListener
from sessioncache.errors import ErrorCode, ProtocolError, SessionNotFound
from sessioncache.hashing import BlockHash
from sessioncache.node import CacheNode
from tests.sessioncache.dataplane.conftest import read_exactly
from tests.sessioncache.dataplane.test_session_ops import (
    BLOCK,
    NS,
    Connect,
    connect,
    node,
    samehost_server,
    stream_server,
)

__all__ = ["connect", "node", "samehost_server", "stream_server"]  # the fixtures


def untouched(node: CacheNode, ids: list[bytes]) -> list[tuple[float, float, int, int]]:
    """What a lookup moves of each block: last access, expiry, hits, references."""
    out = []
    for h in ids:
        meta = node.store.reads.meta(BlockHash(h))
        assert meta is not None
        out.append((meta.last_access, meta.expires_at, meta.hit_count, meta.ref_cnt))
    return out


def test_a_declined_lookup_counts_declined_and_moves_nothing(connect: Connect, node: CacheNode):
    alice, bob = connect("key-a"), connect("key-b")
    root = alice.resolve(NS)
    sid = alice.open_session(kind="agent").id
    rng = np.random.default_rng(int(sid, 16))
    first = rng.integers(0, 50_000, 3 * NS.block_tokens).astype(np.uint32)
    alice.store(root, first, [np.full(BLOCK, i, np.uint8) for i in range(3)], session_id=sid)
    prompt = np.concatenate([first, rng.integers(0, 50_000, 2 * NS.block_tokens)])
    ids = alice.block_hashes(root, prompt)
    before = untouched(node, ids[:3])
    expires = alice.get_session(sid).expires_at

    found = alice.lookup(root, ids, session_id=sid, explain=True, declined=True)
    assert found.matched == 0 and found.lease is None
    assert found.miss is not None and found.miss.reason == "declined" and found.miss.block == 0
    expected = {"diverged": 0, "evicted": 0, "expired": 0, "new": 8, "declined": 12}
    assert found.miss.tokens == expected
    assert untouched(node, ids[:3]) == before
    assert alice.get_session(sid).expires_at == expires
    totals = node.attribution.session_totals(("alice", sid))
    assert totals.lookups == 1 and totals.hit_tokens == 0 and totals.miss_tokens == expected
    # the connector's call: one declined LOOKUP, matching nothing
    assert ops.held(alice, root, ids, session_id=sid, declined=True) == 0
    assert node.attribution.session_totals(("alice", sid)).miss_tokens["declined"] == 24

    # bob names alice's ids under his own root, and her session: nothing to learn or count
    bob_root = bob.resolve(NS)
    other = bob.lookup(bob_root, ids, explain=True, declined=True)
    assert other.matched == 0 and other.miss is not None
    assert other.miss.reason == "new" and other.miss.tokens["declined"] == 0
    with pytest.raises(SessionNotFound):
        bob.lookup(bob_root, ids, session_id=sid, declined=True)
    assert untouched(node, ids[:3]) == before
    totals = node.attribution.session_totals(("alice", sid))
    assert totals.lookups == 2 and totals.miss_tokens["declined"] == 24
    # a plain lookup still finds the blocks
    assert alice.lookup(root, ids, session_id=sid).matched == 3
    alice.close_session(sid)


def test_a_version_3_connection_neither_sends_nor_takes_a_declined_lookup(
    node: CacheNode, stream_server: StreamServer
):
    old = StreamServer(node, TcpListener("127.0.0.1", 0))
    old.versions = frozenset({2, 3})  # a node of before declined lookups
    old.start()
    try:
        with StreamClient.connect(old.address, api_key="key-a") as client:
            assert client.version == 3
            root = client.resolve(NS)
            ids = client.block_hashes(root, list(range(8)))
            with pytest.raises(ProtocolError, match=r"version 3.*declined lookup needs version 4"):
                client.lookup(root, ids, declined=True)
            assert ops.held(client, root, ids, declined=True) == 0  # nothing asked
            assert client.lookup(root, ids).matched == 0  # the connection is fine
    finally:
        old.stop()
    # a node refuses one on a connection of version 3, and carries on
    host, _, port = stream_server.address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(frames.encode_hello(1, frames.Hello("key-a", "v3", (2, 3))))
        header = frames.decode_header(read_exactly(sock, HEADER_SIZE), requests=False)
        assert frames.decode_hello_ok(read_exactly(sock, header.body_len)).version == 3
        sock.sendall(frames.encode_resolve(2, NS))
        header = frames.decode_header(read_exactly(sock, HEADER_SIZE), requests=False)
        root = read_exactly(sock, header.body_len)
        lookup = frames.Lookup(root, [b"i" * 16], declined=True)
        sock.sendall(frames.encode_lookup(3, lookup))
        header = frames.decode_header(read_exactly(sock, HEADER_SIZE), requests=False)
        assert header.opcode == Op.ERROR
        error = frames.decode_error(read_exactly(sock, header.body_len), header.flags)
        assert error.code == ErrorCode.INVALID and not error.closing
        assert "declined LOOKUP is a request of version 4" in error.message
        sock.sendall(frames.encode_lookup(4, lookup._replace(declined=False, explain=True)))
        header = frames.decode_header(read_exactly(sock, HEADER_SIZE), requests=False)
        assert header.opcode == Op.LOOKUP_OK
        ok = frames.decode_lookup_ok(read_exactly(sock, header.body_len))
        assert ok.miss is not None and len(ok.miss.tokens) == 4  # version 3's section


def test_the_declined_flag_and_the_five_count_miss_section_round_trip():
    lookup = frames.Lookup(b"r" * 16, [b"i" * 16], session_id="s", declined=True)
    frame = frames.encode_lookup(5, lookup)
    header = frames.decode_header(frame[:HEADER_SIZE], requests=True)
    assert header.flags & frames.F_LOOKUP_DECLINED
    body = frame[HEADER_SIZE + 2 + 1 :]
    assert frames.decode_lookup(body, frames.Limits(), header.flags, "s") == lookup
    miss = frames.Miss(4, 0, 0, None, None, None, None, (0, 0, 0, 8, 12))
    ok = frames.LookupOk(None, 0, [], [], miss)
    encoded = frames.encode_lookup_ok(1, ok)
    assert frames.decode_lookup_ok(encoded[HEADER_SIZE:]) == ok
    four = frames.encode_lookup_ok(1, ok._replace(miss=miss._replace(tokens=(0, 0, 0, 8))))
    assert len(encoded) - len(four) == struct.calcsize("<Q")
    assert frames.decode_lookup_ok(four[HEADER_SIZE:]).miss == miss._replace(tokens=(0, 0, 0, 8))
