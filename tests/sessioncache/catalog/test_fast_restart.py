"""A started node restarts from the catalog (issue 15): blocks with rows are served at once,
files the catalog lacks are adopted by the background pass (``/readyz`` problem meanwhile),
and a file gone since is a miss whose row is dropped."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from sessioncache.config import Settings
from sessioncache.errors import BlockNotFound
from sessioncache.factory import open_node
from sessioncache.hashing import BlockHash
from sessioncache.node import CacheNode
from sessioncache.tiers.base import PutItem, RecoveredBlock
from sessioncache.tiers.disk import DiskTier

NS = b"fast-restart-ns!"
SIZE = 512


def bid(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def settings(data: Path) -> Settings:
    return Settings(data_dir=data, cpu_bytes=1 << 20, disk_bytes=8 << 20)


def wait_served(node: CacheNode, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while node.health_problems():
        assert time.monotonic() < deadline, node.health_problems()
        time.sleep(0.02)


def test_restart_serves_catalog_rows_and_adopts_files_it_lacks(tmp_path: Path):
    data = tmp_path / "data"
    chain = [bid(i) for i in range(1, 5)]
    node = open_node(settings(data))
    try:
        stored = node.store.writes.put(
            chain, [bytes([i]) * SIZE for i in range(4)], namespace_root=NS, durable=True
        )
        assert stored.stored == chain
        wait_served(node)
    finally:
        node.close()  # flushes the catalog
    # Files the catalog never heard of (their rows were lost with a crash): a chain
    # continuing ours, written by a bare disk tier.
    extra = [bid(i) for i in range(5, 8)]
    disk = DiskTier.open(data / "blocks", 8 << 20)
    parent = chain[-1]
    for i, block in enumerate(extra):
        disk.put(PutItem(block, bytes([10 + i]) * SIZE, NS, parent=parent))
        parent = block
    disk.close()
    # A file with a row, deleted behind the node's back.
    gone = disk.folders.path(chain[-1])
    Path(gone).unlink()

    node = open_node(settings(data))
    try:
        # Served from the catalog's rows at once (no file opened yet).
        assert node.store.reads.contains_many(chain[:3]) == [True, True, True]
        assert node.store.reads.get_bytes(chain[0]) == bytes([0]) * SIZE
        wait_served(node)
        assert node.store.reads.contains_many(extra) == [True, True, True]
        assert node.store.reads.get_bytes(extra[2]) == bytes([12]) * SIZE
        # Linked to their parent, whose file is gone: the chain is held from the gap on.
        assert node.store.reads.chain_to(extra[-1]) == extra
        first = node.store.reads.meta(extra[0])
        assert first is not None and first.parent == chain[-1]
        assert node.store.reads.chain_to(chain[2]) == chain[:3]
        # The vanished file: dropped by the pass (or a miss on its first read), row and all.
        with pytest.raises(BlockNotFound):
            node.store.reads.get_bytes(chain[-1])
        assert not node.store.reads.contains(chain[-1])
        catalog = node.accounting.usage
        assert catalog is not None
        catalog.flush()  # type: ignore[attr-defined]
        rows = {r.block_id for r in catalog.block_records("disk")}  # type: ignore[attr-defined]
        assert rows == {*chain[:3], *extra}
    finally:
        node.close()


def test_readyz_reports_the_background_pass_while_it_runs(tmp_path: Path):
    data = tmp_path / "data"
    disk = DiskTier.open(data / "blocks", 8 << 20)
    for i in range(1, 40):
        disk.put(PutItem(bid(i), bytes([i]) * SIZE, NS))
    disk.close()
    node = open_node(settings(data))
    try:
        problems = node.health_problems()
        # Either still running (said so) or already done (nothing to say).
        assert problems == [] or problems[0].startswith("reconciling"), problems
        wait_served(node)
        assert all(node.store.reads.contains_many([bid(i) for i in range(1, 40)]))
    finally:
        node.close()


def test_a_lookup_during_the_background_pass_finds_the_files_the_catalog_lacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A node killed before its catalog heard of a chain restarts, and an engine asks for
    that chain before the background walk gets to it: the lookup reads the files it asks
    for, so every acknowledged block is served at once."""
    data = tmp_path / "data"
    chain = [bid(i) for i in range(1, 9)]
    disk = DiskTier.open(data / "blocks", 8 << 20)
    parent = None
    for i, block in enumerate(chain):
        disk.put(PutItem(block, bytes([i]) * SIZE, NS, parent=parent))
        parent = block
    disk.close()
    Path(disk.folders.path(chain[6])).write_bytes(b"torn")  # a damaged file ends the run it finds
    walk = threading.Event()
    scan = DiskTier.scan_unindexed

    def held_scan(tier: DiskTier) -> list[RecoveredBlock]:
        walk.wait(30)
        return scan(tier)

    monkeypatch.setattr(DiskTier, "scan_unindexed", held_scan)
    node = open_node(settings(data))
    try:
        assert node.health_problems()[0].startswith("reconciling")
        match = node.store.reads.lookup(chain)
        assert match.hashes == chain[:6]
        assert node.store.reads.get_bytes(chain[5]) == bytes([5]) * SIZE
        assert node.store.reads.chain_to(chain[5]) == chain[:6]
        walk.set()
        wait_served(node)
        assert node.store.reads.lookup(chain).hashes == chain[:6]
    finally:
        walk.set()
        node.close()
    node = open_node(settings(data))  # the rows the lookup's adoption wrote
    try:
        assert node.store.reads.contains_many(chain[:6]) == [True] * 6
    finally:
        node.close()
