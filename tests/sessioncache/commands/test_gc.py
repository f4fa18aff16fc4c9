"""``sessioncache gc``: one sweep of a stopped node's data directory, run as the real command."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sessioncache.config import Settings
from sessioncache.factory import build_store, open_node
from sessioncache.hashing import BlockHash
from sessioncache.node import CacheNode
from tests.support.cli import run_cli_json

NS = b"gc-test-namespac"
SIZE = 1000
TIERS = {"SESSIONCACHE_CPU_BYTES": str(1 << 20), "SESSIONCACHE_DISK_BYTES": str(4 << 20)}


def bid(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def payloads(n: int) -> list[bytes]:
    return [bytes([i + 1]) * SIZE for i in range(n)]


@contextmanager
def node_on(data: Path, **settings: float) -> Iterator[CacheNode]:
    """A node on ``data`` (catalog and disk tier there), stopped on exit as a service is."""
    node = open_node(
        Settings(data_dir=data, cpu_bytes=1 << 20, disk_bytes=4 << 20, **settings), start=False
    )
    try:
        yield node
    finally:
        node.close()


def held(data: Path, ids: list[BlockHash]) -> list[bool]:
    """Which of ``ids`` the data directory's disk tier still holds (opened afresh)."""
    store = build_store(Settings(data_dir=data, cpu_bytes=1 << 20, disk_bytes=4 << 20))
    try:
        return store.reads.contains_many(ids)
    finally:
        store.close()


def test_gc_frees_expired_blocks_and_keeps_a_live_sessions_chain(tmp_path: Path):
    # Both the node and gc run with a 1 s default TTL, so the loose blocks' TTL is 1 s
    # whether or not it survives the restart; the session's chain lives as long as the
    # session (3 days), which gc finds open and pins again on start.
    data = tmp_path / "data"
    loose, chain = [bid(1), bid(2)], [bid(3), bid(4), bid(5)]
    with node_on(data, default_ttl_s=1.0) as node:
        assert (
            node.store.writes.put(loose, payloads(2), namespace_root=NS, durable=True).stored
            == loose
        )
        node.sessions.open("keep")
        stored = node.store.writes.put(chain, payloads(3), namespace_root=NS, durable=True)
        node.sessions.record("keep", chain)
        assert stored.stored == chain
        disk = {t.name: t for t in node.store.stats_tiers()}["disk"]
        assert (disk.blocks, disk.used_bytes) == (5, 5 * SIZE)
    time.sleep(1.2)

    out = run_cli_json(
        "gc", "--data-dir", str(data), env={**TIERS, "SESSIONCACHE_DEFAULT_TTL_S": "1"}
    )

    # The CPU tier is empty after a restart: everything freed was on disk.
    assert out == {
        "expired_sessions": 0,
        "idle_unpinned": 0,
        "expired_blocks": 2,
        "freed_bytes": {"cpu": 0, "disk": 2 * SIZE},
    }
    assert held(data, loose + chain) == [False, False, True, True, True]


def test_gc_frees_blocks_whose_own_ttl_passed_while_the_node_was_stopped(tmp_path: Path):
    # Default TTL (3 days) everywhere; two blocks were stored with a TTL of their own, 1 s.
    data = tmp_path / "data"
    short, default = [bid(1), bid(2)], [bid(3)]
    with node_on(data) as node:
        node.store.writes.put(short, payloads(2), namespace_root=NS, ttl_s=1.0, durable=True)
        node.store.writes.put(default, payloads(1), namespace_root=NS, durable=True)
    time.sleep(1.2)

    out = run_cli_json("gc", "--data-dir", str(data), env=TIERS)

    assert out["expired_blocks"] == 2 and out["freed_bytes"] == {"cpu": 0, "disk": 2 * SIZE}
    assert held(data, short + default) == [False, False, True]
