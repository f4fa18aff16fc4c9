"""Start-up reconciliation with a real DiskTier: adopt, quarantine, drop; parents restored."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from sessioncache.catalog import BlockRecord
from sessioncache.catalog.reconcile import CatalogRecoveredTier, checksum_of, reconcile
from sessioncache.clock import ManualClock
from sessioncache.hashing import BlockHash, Namespace, block_hashes
from sessioncache.store import TieredStore
from sessioncache.tiers.base import PutItem, RecoverableTier, Tier
from sessioncache.tiers.cpu import CpuTier
from sessioncache.tiers.disk import DiskTier

NS = Namespace("test-model", 4, "float16", "test-layout")
ROOT = NS.root()
SIZE = 4096
CAPACITY = 1 << 24


def chain(seed: int, blocks: int) -> list[BlockHash]:
    rng = np.random.default_rng(seed)
    return block_hashes(NS, rng.integers(0, 50_000, blocks * NS.block_tokens))


def data(h: bytes) -> bytes:
    return (h * (SIZE // 16))[:SIZE]


def block_file(root: Path, h: bytes) -> Path:
    hexid = h.hex()
    return root / "blocks" / hexid[0:2] / hexid[2:4] / f"{hexid}.blk"


def corrupt_payload(root: Path, h: bytes) -> None:
    path = block_file(root, h)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))


def write_files(root: Path, hashes: list[BlockHash]) -> None:
    """Blocks on disk that no catalog heard of (as if the rows were lost in a crash)."""
    tier = DiskTier.open(root, CAPACITY, fsync=False)
    for h in hashes:
        tier.put(PutItem(h, data(h), ROOT))


def open_store(root: Path, catalog=None) -> TieredStore:
    observers = [catalog] if catalog is not None else []
    return TieredStore([DiskTier.open(root, CAPACITY, fsync=False)], observers=observers)


def test_files_without_rows_are_adopted(make_catalog, tmp_path, caplog):
    root = tmp_path / "disk"
    hashes = chain(1, 4)
    write_files(root, hashes)
    catalog = make_catalog()
    store = open_store(root, catalog)
    with caplog.at_level(logging.INFO, logger="sessioncache.catalog.reconcile"):
        report = reconcile(catalog, store)
    assert (report.adopted, report.quarantined, report.dropped_rows, report.kept) == (4, 0, 0, 0)
    assert "adopted 4, quarantined 0, dropped 0 rows" in caplog.text
    records = {r.block_id: r for r in catalog.block_records()}
    assert set(records) == set(hashes)
    for h in hashes:
        assert records[h].tier == "disk"
        assert records[h].nbytes == SIZE
        assert records[h].checksum == checksum_of(store.reads.get(h))
    # A second run finds nothing to do.
    again = reconcile(catalog, store)
    assert (again.adopted, again.quarantined, again.dropped_rows, again.kept) == (0, 0, 0, 4)


def test_a_corrupt_file_without_a_row_is_quarantined(make_catalog, tmp_path):
    root = tmp_path / "disk"
    hashes = chain(2, 3)
    write_files(root, hashes)
    corrupt_payload(root, hashes[1])
    catalog = make_catalog()
    store = open_store(root, catalog)
    assert store.reads.contains(hashes[1])  # the header scan cannot tell
    report = reconcile(catalog, store)
    assert (report.adopted, report.quarantined, report.dropped_rows) == (2, 1, 0)
    assert not store.reads.contains(hashes[1])
    assert {r.block_id for r in catalog.block_records()} == {hashes[0], hashes[2]}
    assert [p.name.split(".")[0] for p in (root / "quarantine").iterdir()] == [hashes[1].hex()]
    assert not block_file(root, hashes[1]).exists()


def test_without_verification_files_are_adopted_unread(make_catalog, tmp_path):
    root = tmp_path / "disk"
    hashes = chain(3, 2)
    write_files(root, hashes)
    corrupt_payload(root, hashes[0])
    catalog = make_catalog()
    store = open_store(root, catalog)
    report = reconcile(catalog, store, verify=False)
    assert (report.adopted, report.quarantined) == (2, 0)
    assert all(r.checksum is None for r in catalog.block_records())


def test_rows_without_files_are_dropped(make_catalog, tmp_path):
    root = tmp_path / "disk"
    hashes = chain(4, 3)
    catalog = make_catalog()
    store = open_store(root, catalog)
    store.writes.put(hashes, [data(h) for h in hashes], namespace_root=ROOT)
    catalog.flush()
    store.close()
    block_file(root, hashes[2]).unlink()  # lost by hand
    # and a row for a block this tier never had
    ghost = BlockRecord(BlockHash(b"\x05" * 16), "disk", ROOT, None, SIZE, 1.0, 1.0, 2.0, 1.0)
    other_tier = BlockRecord(BlockHash(b"\x06" * 16), "disk2", ROOT, None, SIZE, 1.0, 1.0, 2.0, 1.0)
    catalog.upsert_blocks([ghost, other_tier])

    store = open_store(root, catalog)
    report = reconcile(catalog, store)
    assert (report.adopted, report.quarantined, report.dropped_rows, report.kept) == (0, 0, 2, 2)
    assert {(r.block_id, r.tier) for r in catalog.block_records()} == {
        (hashes[0], "disk"),
        (hashes[1], "disk"),
        (other_tier.block_id, "disk2"),  # other tiers' rows are not this store's business
    }


def test_reconcile_a_bare_tier_before_building_the_store(make_catalog, tmp_path):
    root = tmp_path / "disk"
    hashes = chain(5, 3)
    write_files(root, hashes)
    corrupt_payload(root, hashes[2])
    catalog = make_catalog()
    tier = DiskTier.open(root, CAPACITY, fsync=False)
    report = reconcile(catalog, [CpuTier(1 << 20), tier], default_ttl_s=100.0)
    assert (report.adopted, report.quarantined, report.dropped_rows) == (2, 1, 0)
    records = catalog.block_records("disk")
    assert {r.block_id for r in records} == set(hashes[:2])
    assert all(r.expires_at == r.last_access + 100.0 for r in records)
    assert not tier.contains(hashes[2])


def test_catalog_recovered_tier_restores_chains(make_catalog, tmp_path):
    root = tmp_path / "disk"
    hashes = chain(6, 5)
    catalog = make_catalog()
    store = open_store(root, catalog)
    store.writes.put(hashes, [data(h) for h in hashes], namespace_root=ROOT, durable=True)
    store.reads.lookup(hashes)
    catalog.flush()
    last_access = store.reads.meta(hashes[0]).last_access
    store.close()

    # The disk tier's files record parents: even a bare restart keeps the chain.
    plain = open_store(root)
    assert plain.reads.chain_to(hashes[-1]) == hashes

    wrapped = CatalogRecoveredTier(DiskTier.open(root, CAPACITY, fsync=False), catalog)
    assert isinstance(wrapped, Tier) and isinstance(wrapped, RecoverableTier)
    assert wrapped.root == root  # anything else goes to the tier
    store = TieredStore([wrapped], observers=[catalog])
    assert store.reads.chain_to(hashes[-1]) == hashes
    assert store.reads.meta(hashes[0]).last_access >= last_access
    assert bytes(store.reads.get(hashes[3]).numpy()) == data(hashes[3])
    report = reconcile(catalog, store)
    assert (report.adopted, report.dropped_rows, report.kept) == (0, 0, 5)


def test_catalog_recovered_tier_needs_a_recoverable_tier(make_catalog):
    with pytest.raises(TypeError):
        CatalogRecoveredTier(CpuTier(1024), make_catalog())


def test_a_restart_keeps_each_blocks_own_ttl(make_catalog, tmp_path):
    """Issue 8, bug 1: the catalog is the truth for TTLs. A short-TTL block that expired
    while the node was down misses after the restart and is freed by the sweep; a block whose
    TTL a session raised above the default keeps that expiry."""
    root = tmp_path / "disk"
    clock = ManualClock()
    short, long_ = chain(7, 3), chain(8, 3)
    catalog = make_catalog(clock=clock)
    store = TieredStore(
        [DiskTier.open(root, CAPACITY, fsync=False)],
        observers=[catalog],
        clock=clock,
        default_ttl_s=100.0,
    )
    store.writes.put(short, [data(h) for h in short], namespace_root=ROOT, durable=True, ttl_s=2.0)
    store.writes.put(long_, [data(h) for h in long_], namespace_root=ROOT, durable=True)
    store.reads.lookup(long_, ttl_s=7 * 86400.0)  # a chat session raises the TTL to 7 days
    raised = store.reads.meta(long_[-1]).expires_at
    catalog.flush()
    store.close()

    clock.advance(10.0)  # the node is down while the short blocks expire
    wrapped = CatalogRecoveredTier(DiskTier.open(root, CAPACITY, fsync=False), catalog)
    store = TieredStore([wrapped], observers=[catalog], clock=clock, default_ttl_s=100.0)
    assert store.reads.lookup(short).num_blocks == 0
    assert store.reads.lookup(long_).num_blocks == 3
    assert store.reads.meta(long_[0]).ttl_s == 7 * 86400.0
    assert store.reads.meta(long_[-1]).expires_at >= raised
    assert store.writes.expire() == 3
    assert store.reads.where(short[0]) == []
    clock.advance(200.0)  # past the default TTL, well within the raised one
    assert store.reads.lookup(long_).num_blocks == 3
