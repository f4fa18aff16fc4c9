"""The catalog's rows of a tier as a fast restart reads them (``Catalog.iter_recovered`` and
its columnar form, ``iter_recovered_batches``): every column exact, other tiers left out."""

from __future__ import annotations

import itertools
import random
import threading
from dataclasses import replace

import numpy as np
import pytest

from sessioncache.catalog import BlockRecord, CatalogRecoveredTier, bulk
from sessioncache.hashing import BlockHash
from sessioncache.tiers.base import BatchRecoverableTier, PutItem, RecoveredBatch, RecoveredBlock
from sessioncache.tiers.disk import DiskTier

ROOTS = [b"\x01" * 16, b"\x00" * 15 + b"\x02"]


def bid(i: int) -> BlockHash:
    # Leading and trailing zero bytes on purpose: no byte of an id may be lost on the way.
    return BlockHash(i.to_bytes(16, "little" if i % 2 else "big"))


def records(n: int, tier: str = "disk", seed: int = 7) -> list[BlockRecord]:
    rng = random.Random(seed)
    out = []
    for i in range(1, n + 1):
        last = 1.7e9 + rng.random() * 1e6
        ttl = [3600.0, 86400.5, 1e-3][i % 3]
        out.append(
            BlockRecord(
                block_id=bid(i),
                tier=tier,
                namespace_root=ROOTS[i % 2],
                parent=None if i % 5 == 0 else bid(i - 1),
                nbytes=[64, 2 << 20, 1 << 40][i % 3],
                created=last - 10.0,
                last_access=last,
                expires_at=last + ttl + rng.random(),
                ttl_s=ttl,
            )
        )
    return out


def expected(rows: list[BlockRecord]) -> dict[bytes, RecoveredBlock]:
    return {
        r.block_id: RecoveredBlock(
            r.block_id,
            r.namespace_root,
            r.nbytes,
            r.last_access,
            r.parent,
            ttl_s=r.ttl_s,
            expires_at=r.expires_at,
        )
        for r in rows
    }


def test_iter_recovered_gives_every_column_exactly(make_catalog):
    catalog = make_catalog()
    rows = records(1234)
    catalog.upsert_blocks(rows)
    catalog.upsert_blocks(records(50, tier="ssd", seed=8))
    got = list(catalog.iter_recovered("disk"))
    assert len(got) == len(rows)
    assert {b.block_hash: b for b in got} == expected(rows)
    for block in got:
        assert type(block.block_hash) is bytes and len(block.block_hash) == 16
        assert type(block.nbytes) is int
        assert type(block.mtime) is float and type(block.expires_at) is float
    # one object per namespace root, and per TTL and batch: the index keeps them by the million
    assert len({id(b.namespace_root) for b in got}) == len(ROOTS)
    batches = len(list(catalog.iter_recovered_batches("disk")))
    assert len({id(b.ttl_s) for b in got}) <= 3 * batches
    assert len({id(b.nbytes) for b in got}) <= 3 * batches


def test_iter_recovered_of_an_empty_tier(make_catalog):
    catalog = make_catalog()
    catalog.upsert_blocks(records(3, tier="ssd"))
    assert list(catalog.iter_recovered("disk")) == []


def test_batches_are_the_same_rows_in_columns(make_catalog):
    catalog = make_catalog()
    rows = records(1234)
    catalog.upsert_blocks(rows)
    batches = list(catalog.iter_recovered_batches("disk", batch_rows=100))
    assert sum(len(b) for b in batches) == len(rows)
    assert max(len(b) for b in batches) == 100
    got = [block for batch in batches for block in batch.blocks()]
    assert {b.block_hash: b for b in got} == expected(rows)
    for batch in batches:
        assert batch.nbytes.dtype == np.int64 and batch.mtime.dtype == np.float64
        assert len(batch.ids) == len(batch.parents) == len(batch.namespace_roots)
        assert len(batch.ttl_s) == len(batch.expires_at) == len(batch.mtime) == len(batch)
    # roots interned across batches, not only within one
    assert len({id(r) for batch in batches for r in batch.namespace_roots}) == len(ROOTS)


def test_one_namespace_and_one_ttl_share_objects(make_catalog):
    catalog = make_catalog()
    rows = [replace(r, namespace_root=ROOTS[0], ttl_s=60.0, nbytes=4096) for r in records(300)]
    catalog.upsert_blocks(rows)
    got = list(catalog.iter_recovered("disk"))
    assert {b.block_hash: b for b in got} == expected(rows)
    assert len({id(b.namespace_root) for b in got}) == 1
    assert len({id(b.ttl_s) for b in got}) == 1


def test_sqlalchemy_path_reads_the_same_rows(make_catalog):
    """The path of a driver other than sqlite3 and psycopg 3."""
    catalog = make_catalog()
    rows = records(250)
    catalog.upsert_blocks(rows)
    with catalog.engine.connect() as conn:
        batches = [bulk.batch_of(chunk) for chunk in bulk.sqlalchemy_rows(conn, "disk", 100)]
    assert [len(b) for b in batches] == [100, 100, 50]
    got = [block for batch in batches for block in batch.blocks()]
    assert {b.block_hash: b for b in got} == expected(rows)


def test_batch_of_blocks_round_trips_unrecorded_ttl_and_expiry():
    blocks = [
        RecoveredBlock(bid(1), ROOTS[0], 64, 5.0, None),
        RecoveredBlock(bid(2), ROOTS[1], 128, 6.0, bid(1), ttl_s=30.0),
        RecoveredBlock(bid(3), ROOTS[1], 128, 7.0, bid(2), ttl_s=30.0, expires_at=99.5),
    ]
    batch = RecoveredBatch.of(blocks)
    assert list(batch.blocks()) == blocks
    assert list(RecoveredBatch.of([]).blocks()) == []


def test_prefetched_hands_over_items_and_the_producers_error():
    def produce():
        yield from range(10)
        raise ValueError("the read failed")

    got = []
    with pytest.raises(ValueError, match="the read failed"):
        for item in bulk.prefetched(produce, depth=2):
            got.append(item)
    assert got == list(range(10))


def test_closing_prefetched_early_stops_and_closes_the_producer():
    closed = threading.Event()

    def produce():
        try:
            yield from itertools.count()
        finally:
            closed.set()

    items = bulk.prefetched(produce, depth=2)
    assert [next(items) for _ in range(5)] == [0, 1, 2, 3, 4]
    items.close()
    assert closed.is_set()
    assert not any(t.name == "sessioncache-catalog-read" for t in threading.enumerate())


def test_abandoned_read_releases_its_connection(make_catalog):
    catalog = make_catalog()
    catalog.upsert_blocks(records(300))
    batches = catalog.iter_recovered_batches("disk", batch_rows=10)
    assert len(next(batches)) == 10
    batches.close()
    assert catalog.engine.pool.checkedout() == 0
    assert len(list(catalog.iter_recovered("disk"))) == 300


def test_rows_of_many_sizes_and_ttls_are_all_read(make_catalog):
    """The rows of the first row's (root, size, TTL) are read apart from the others."""
    catalog = make_catalog()
    rows = [replace(r, ttl_s=60.0 + i % 19, nbytes=64 + i % 2) for i, r in enumerate(records(500))]
    catalog.upsert_blocks(rows)
    batches = list(catalog.iter_recovered_batches("disk", batch_rows=100))
    assert sum(len(b) for b in batches) == len(rows)
    got = [block for batch in batches for block in batch.blocks()]
    assert {b.block_hash: b for b in got} == expected(rows)


def test_catalog_recovered_tier_hands_batches_to_the_tier_and_its_owner(make_catalog, tmp_path):
    catalog = make_catalog()
    rows = records(40)
    catalog.upsert_blocks(rows)
    disk = DiskTier.open(tmp_path / "disk", 1 << 50, scan=False)
    tier = CatalogRecoveredTier(disk, catalog, from_catalog=True)
    assert isinstance(tier, BatchRecoverableTier)
    batches = list(tier.recovered_batches())
    got = [block for batch in batches for block in batch.blocks()]
    assert {b.block_hash: b for b in got} == expected(rows)
    assert sorted(disk.keys()) == sorted(r.block_id for r in rows)
    assert disk.used_bytes == sum(r.nbytes for r in rows)


def test_catalog_recovered_tier_batches_a_scanned_tier_too(make_catalog, tmp_path):
    catalog = make_catalog()
    disk = DiskTier.open(tmp_path / "disk", 1 << 30)
    for i in range(1, 6):
        disk.put(PutItem(bid(i), bytes([i]) * 64, ROOTS[0], parent=bid(i - 1) if i > 1 else None))
    rows = [r for r in records(3) if r.namespace_root == ROOTS[0]]  # rows for some files
    catalog.upsert_blocks([replace(r, nbytes=64) for r in rows])
    disk = DiskTier.open(tmp_path / "disk", 1 << 30)
    tier = CatalogRecoveredTier(disk, catalog)
    one_by_one = {b.block_hash: b for b in tier.recovered()}
    batched = [b for batch in tier.recovered_batches() for b in batch.blocks()]
    assert {b.block_hash: b for b in batched} == one_by_one
    assert len(one_by_one) == 5
