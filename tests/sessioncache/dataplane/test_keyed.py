"""Keyed blocks (``F_STORE_KEYED``, ``F_LOOKUP_KEYED``, ``F_LOAD_EACH``, EXISTS): stored, found,
located and loaded by engine keys, on the stream and through shared memory, with a node in this
process (so that the records' parents can be read) and its real sockets; tenant isolation
against a real ``sessioncache serve``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from sessioncache.config import Settings
from sessioncache.connector import StreamClient
from sessioncache.connector.samehost import SameHostClient
from sessioncache.dataplane import frames
from sessioncache.dataplane.frames import KEY_WORDS, Exists, Op, StoreHead
from sessioncache.errors import InvalidInput
from sessioncache.factory import open_node
from sessioncache.hashing import (
    KEY_BYTES,
    BlockHash,
    Namespace,
    block_hashes_from_bytes,
    block_key,
    keyed_block_ids,
)
from sessioncache.node import CacheNode
from sessioncache.operations import lookups
from sessioncache.operations.caller import Caller
from tests.sessioncache.dataplane.conftest import connect, pattern, wait_until
from tests.support.servers import Server, start_server

NS = Namespace("keyed-model", block_tokens=256, kv_dtype="opaque", kv_layout="keyed-test")
SIZE = 4096


def keys(prefix: str, n: int) -> list[bytes]:
    return [block_key(f"{prefix}@{i:x}") for i in range(n)]


# -- ids and frames (no I/O) ------------------------------------------------------------------


def test_keyed_ids_need_only_the_root_and_the_key():
    root = NS.root()
    k = keys("a", 3)
    ids = keyed_block_ids(root, k)
    assert ids == [keyed_block_ids(root, [key])[0] for key in k]  # no context
    assert len(set(ids)) == 3 and all(len(i) == 16 for i in ids)
    assert keyed_block_ids(Namespace("other", 256, "opaque", "keyed-test").root(), k) != ids
    assert keyed_block_ids(root, k, seed=7) != ids
    # a chain of 4-token blocks from the root over the key bytes is another id
    assert block_hashes_from_bytes(root, k[0], KEY_WORDS) != [ids[0]]
    assert block_key("x") == block_key(b"x") and len(block_key("x" * 100)) == KEY_BYTES
    with pytest.raises(InvalidInput):
        keyed_block_ids(root, [b"short"])


def test_keyed_store_head_and_exists_round_trip():
    head = StoreHead(b"r" * 16, None, KEY_WORDS, 2, 100, 0, keyed=True, linked=False)
    frame = frames.encode_store_head(5, head, b"k" * 32)
    header = frames.decode_header(frame[: frames.HEADER_SIZE], requests=True)
    assert header.flags == frames.F_STORE_KEYED
    fixed = frame[frames.HEADER_SIZE : frames.HEADER_SIZE + frames.STORE_FIXED]
    assert frames.decode_store_head(fixed, header, frames.Limits()) == head
    linked = head._replace(linked=True, parent=b"p" * 16)
    frame = frames.encode_store_head(5, linked, b"k" * 32)
    header = frames.decode_header(frame[: frames.HEADER_SIZE], requests=True)
    assert header.flags == frames.F_STORE_KEYED | frames.F_STORE_LINKED | frames.F_STORE_PARENT
    fixed = frame[frames.HEADER_SIZE : frames.HEADER_SIZE + frames.STORE_FIXED]
    assert frames.decode_store_head(fixed, header, frames.Limits()) == linked
    # a keyed STORE whose block_tokens is not a key's word count is refused, not misread
    bad = frames.encode_store_head(5, head._replace(block_tokens=8), b"k" * 64)
    header = frames.decode_header(bad[: frames.HEADER_SIZE], requests=True)
    with pytest.raises(InvalidInput):
        frames.decode_store_head(
            bad[frames.HEADER_SIZE : frames.HEADER_SIZE + frames.STORE_FIXED],
            header,
            frames.Limits(),
        )

    frame = frames.encode_exists(9, exists=Exists(b"r" * 16, [b"a" * 16, b"b" * 16]))
    header = frames.decode_header(frame[: frames.HEADER_SIZE], requests=True)
    assert header.opcode == Op.EXISTS
    got = frames.decode_exists(frame[frames.HEADER_SIZE :], frames.Limits())
    assert got == Exists(b"r" * 16, [b"a" * 16, b"b" * 16])
    ok = frames.encode_exists_ok(9, [True, False, True])
    assert frames.decode_exists_ok(ok[frames.HEADER_SIZE :]) == [True, False, True]


# -- a node in this process ---------------------------------------------------------------------


@pytest.fixture
def node(tmp_path: Path) -> Iterator[CacheNode]:
    settings = Settings(data_dir=tmp_path / "data", cpu_bytes=32 << 20, disk_bytes=0)
    node = open_node(settings, start=False)
    yield node
    node.close()


def test_stream_keyed_store_exists_and_load(node: CacheNode, stream: StreamClient):
    root = stream.resolve(NS)
    k = keys("s", 6)
    ids = stream.key_ids(root, k)
    ack = stream.store_keyed(root, k[:4], [pattern(h, SIZE) for h in ids[:4]], linked=False)
    assert ack.hashes == ids[:4] and ack.stored == 4
    assert stream.exists(root, ids) == [True] * 4 + [False] * 2
    assert stream.exists(root, ids[::-1]) == [False] * 2 + [True] * 4
    for h in ids[:4]:  # standing alone: no parent, so each may be evicted on its own
        meta = node.store.reads.meta(BlockHash(h))
        assert meta is not None and meta.parent is None and meta.namespace_root == root

    # a keyed LOOKUP needs no chain: the held run of the ids asked, from any one of them
    assert stream.lookup(root, ids[2:], keyed=True).matched == 2
    # as a chain they do not link: a standalone keyed block is a chain of one
    assert stream.lookup(root, ids[2:]).matched == 1
    found = stream.lookup(root, [ids[3], ids[1]], keyed=True, lease_ms=10_000)
    out = np.zeros((2, SIZE), np.uint8)
    stream.load_into(found, list(out), release=True)
    assert np.array_equal(out[0], pattern(ids[3], SIZE))
    assert np.array_equal(out[1], pattern(ids[1], SIZE))

    # LOAD each: a held block after a missing one still comes
    asked = [ids[0], ids[5], ids[2], ids[4], ids[3]]
    out = np.zeros((5, SIZE), np.uint8)
    got = stream.load_into(asked, list(out), each=True)
    assert got == [True, False, True, False, True]
    for row, h, ok in zip(out, asked, got, strict=True):
        assert not ok or np.array_equal(row, pattern(h, SIZE))
    assert stream.load_into(asked, list(out)) == [True, False, False, False, False]
    # a LOAD's lease ends just after its last block is sent
    wait_until(lambda: node.store.stats().leases == 0)


def test_linked_keyed_batches_are_chains(node: CacheNode, stream: StreamClient):
    root = stream.resolve(NS)
    k = keys("chain", 5)
    ids = stream.key_ids(root, k)
    stream.store_keyed(root, k[:3], [pattern(h, SIZE) for h in ids[:3]])
    # the next batch continues the same request: block 0 hangs off the last one stored
    ack = stream.store_keyed(root, k[3:], [pattern(h, SIZE) for h in ids[3:]], parent=ids[2])
    assert ack.stored == 2
    assert node.store.reads.chain_to(BlockHash(ids[4])) == ids
    # a parent that is not held under the root is refused
    with pytest.raises(Exception, match="not held"):
        stream.store_keyed(root, keys("x", 1), [np.zeros(SIZE, np.uint8)], parent=b"\0" * 16)


def test_a_session_pins_a_linked_keyed_chain(node: CacheNode, stream: StreamClient):
    root = stream.resolve(NS)
    k = keys("session", 4)
    ids = stream.key_ids(root, k)
    stream.store_keyed(root, k, [pattern(h, SIZE) for h in ids])
    session = node.sessions.open(tenant="default")
    # what POST /v1/lookup with block_ids_b64 and a session_id does
    found = lookups.lookup_ids(
        node, Caller("default"), NS, [BlockHash(h) for h in ids], session_id=session.id
    )
    assert found.match.num_blocks == 4
    assert all(node.store.reads.meta(BlockHash(h)).ref_cnt for h in ids)  # type: ignore[union-attr]


def test_samehost_keyed_store_locate_and_load(node: CacheNode, samehost: SameHostClient):
    root = samehost.resolve(NS)
    k = keys("shm", 4)
    ids = samehost.key_ids(root, k)
    ack = samehost.store_keyed(root, k[:3], [pattern(h, SIZE) for h in ids[:3]], linked=False)
    assert ack.stored == 3 and ack.hashes == ids[:3]
    assert all(node.store.reads.meta(BlockHash(h)).parent is None for h in ids[:3])  # type: ignore[union-attr]
    assert samehost.exists(root, ids) == [True, True, True, False]
    found = samehost.locate(root, [ids[2], ids[0], ids[3]], keyed=True)
    assert found.located == 2
    out = np.zeros((2, SIZE), np.uint8)
    samehost.load_into(found, list(out), verify=True)
    assert np.array_equal(out[0], pattern(ids[2], SIZE))
    assert np.array_equal(out[1], pattern(ids[0], SIZE))
    assert samehost.locate(root, [ids[3]], keyed=True).located == 0
    # a linked staged batch is a chain
    k2 = keys("shm-chain", 3)
    ids2 = samehost.key_ids(root, k2)
    samehost.store_keyed(root, k2, [pattern(h, SIZE) for h in ids2])
    assert node.store.reads.chain_to(BlockHash(ids2[-1])) == ids2


# -- tenants, against a real node ---------------------------------------------------------------

KEYS = {"key-acme": "acme", "key-globex": "globex"}


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("keyed-auth") / "data", {"SESSIONCACHE_API_KEYS": json.dumps(KEYS)}
    )
    yield server
    server.stop()


def test_keyed_blocks_are_the_tenants_own(auth_server: Server):
    acme = connect(auth_server, "key-acme")
    globex = connect(auth_server, "key-globex")
    try:
        k = keys("tenant", 3)
        root_a = acme.resolve(NS)
        ids_a = acme.key_ids(root_a, k)
        acme.store_keyed(root_a, k, [pattern(h, SIZE) for h in ids_a], linked=False)
        root_g = globex.resolve(NS)
        ids_g = globex.key_ids(root_g, k)
        assert root_g != root_a and set(ids_g).isdisjoint(ids_a)  # the tenant salt
        assert globex.exists(root_g, ids_g) == [False] * 3
        # naming the other tenant's ids: a miss on every path
        with pytest.raises(Exception, match="not resolved"):
            globex.exists(root_a, ids_a)
        out = np.zeros((3, SIZE), np.uint8)
        assert globex.load_into(ids_a, list(out), each=True) == [False] * 3
        assert acme.load_into(ids_a, list(out), each=True) == [True] * 3
        assert acme.exists(root_a, ids_a) == [True] * 3
    finally:
        acme.close()
        globex.close()
