"""Write-behind: the store's observer calls never run SQL; flush() and the flusher thread do."""

from __future__ import annotations

import time

import numpy as np
import pytest
from sqlalchemy import event

from sessioncache.catalog import BlockRecord
from sessioncache.clock import ManualClock
from sessioncache.hashing import BlockHash, Namespace, block_hashes
from sessioncache.store import TieredStore
from sessioncache.store.blocks import BlockMeta
from sessioncache.store.table import BlockFields
from sessioncache.tiers.cpu import CpuTier
from sessioncache.tiers.disk import DiskTier

NS = Namespace("test-model", 4, "float16", "test-layout")
ROOT = NS.root()
SIZE = 4096


def chain(seed: int, blocks: int) -> list[BlockHash]:
    rng = np.random.default_rng(seed)
    return block_hashes(NS, rng.integers(0, 50_000, blocks * NS.block_tokens))


def data(h: bytes) -> bytes:
    return (h * (SIZE // 16))[:SIZE]


class SqlCounter:
    """Counts the statements an engine runs (``executemany`` rows in ``rows``)."""

    def __init__(self, engine) -> None:
        self.statements: list[tuple[str, int]] = []
        event.listen(engine, "before_cursor_execute", self._on)

    def _on(self, conn, cursor, statement, parameters, context, executemany) -> None:
        rows = len(parameters) if executemany else 1
        self.statements.append((statement.split()[0].upper(), rows))

    def clear(self) -> None:
        self.statements.clear()

    def rows(self, verb: str) -> int:
        return sum(n for v, n in self.statements if v == verb)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def store_and_catalog(make_catalog, tmp_path, clock):
    catalog = make_catalog(clock=clock)
    disk = DiskTier.open(tmp_path / "disk", 1 << 24, fsync=False)
    store = TieredStore([CpuTier(1 << 20), disk], clock=clock, observers=[catalog])
    yield store, catalog
    store.close()


def put(store: TieredStore, hashes: list[BlockHash], **kw) -> None:
    store.writes.put(hashes, [data(h) for h in hashes], namespace_root=ROOT, **kw)


def test_observer_calls_run_no_sql_until_flush(store_and_catalog, clock):
    store, catalog = store_and_catalog
    sql = SqlCounter(catalog.engine)
    hashes = chain(1, 5)
    put(store, hashes, durable=True)
    for _ in range(10):
        store.reads.lookup(hashes)
    store.reads.get(hashes[0])
    assert sql.statements == []
    assert catalog.pending() > 0
    assert catalog.count_blocks() == 0  # nothing written behind yet

    assert catalog.flush() > 0
    assert catalog.pending() == 0
    records = {r.block_id: r for r in catalog.block_records()}
    assert set(records) == set(hashes)
    assert {r.tier for r in records.values()} == {"disk"}  # the cpu tier is not durable
    for i, h in enumerate(hashes):
        meta = store.reads.meta(h)
        assert meta is not None
        r = records[h]
        assert (r.namespace_root, r.nbytes) == (ROOT, SIZE)
        assert r.parent == (hashes[i - 1] if i else None)
        assert (r.created, r.last_access, r.expires_at, r.ttl_s) == (
            meta.created,
            meta.last_access,
            meta.expires_at,
            meta.ttl_s,
        )
        assert r.hit_count == meta.hit_count
    assert set(catalog.namespaces()) == {ROOT}
    assert catalog.flush() == 0  # nothing left


def test_touches_coalesce_per_block(store_and_catalog, clock):
    store, catalog = store_and_catalog
    hashes = chain(2, 4)
    put(store, hashes, durable=True)
    catalog.flush()
    sql = SqlCounter(catalog.engine)
    for _ in range(1000):
        clock.advance(1.0)
        store.reads.lookup(hashes, ttl_s=7 * 86400.0)
    assert sql.statements == []
    catalog.flush()
    # One UPDATE row per block, whatever the number of lookups.
    assert sql.rows("UPDATE") == len(hashes)
    for r in catalog.block_records("disk"):
        assert r.hit_count == 1000
        assert r.last_access == clock.now()
        assert r.ttl_s == 7 * 86400.0
        assert r.expires_at == clock.now() + 7 * 86400.0


def test_removed_blocks_lose_their_rows(store_and_catalog):
    store, catalog = store_and_catalog
    hashes = chain(3, 3)
    put(store, hashes, durable=True)
    catalog.flush()
    assert catalog.count_blocks("disk") == 3
    assert store.writes.delete([hashes[2]]) == 1
    catalog.flush()
    assert {r.block_id for r in catalog.block_records()} == set(hashes[:2])
    # Added then removed within one batch: no row at all.
    more = chain(4, 2)
    put(store, more, durable=True)
    store.writes.delete(more[::-1])
    catalog.flush()
    assert {r.block_id for r in catalog.block_records()} == set(hashes[:2])


def test_demotion_to_a_durable_tier_adds_rows(make_catalog, tmp_path, clock):
    catalog = make_catalog(clock=clock)
    disk = DiskTier.open(tmp_path / "disk", 1 << 24, fsync=False)
    store = TieredStore([CpuTier(4 * SIZE), disk], clock=clock, observers=[catalog])
    first = chain(5, 4)
    put(store, first)  # cpu only: no rows
    catalog.flush()
    assert catalog.count_blocks() == 0
    clock.advance(1)
    put(store, chain(6, 4))  # evicts ``first`` from cpu down to disk
    catalog.flush()
    assert {r.block_id for r in catalog.block_records("disk")} == set(first)
    store.close()


def test_bound_tiers_skip_touches_of_non_durable_blocks(store_and_catalog):
    store, catalog = store_and_catalog
    catalog.bind_tiers(store.tiers)
    cpu_only = chain(7, 3)
    put(store, cpu_only)
    catalog.flush()
    store.reads.lookup(cpu_only)
    assert catalog.pending() == 1  # the blocks_touched counter only
    durable = chain(8, 3)
    put(store, durable, durable=True)
    catalog.flush()
    store.reads.lookup(durable)
    assert catalog.pending() == 1 + 3


def test_background_flusher_writes_within_a_few_intervals(make_catalog, tmp_path):
    catalog = make_catalog(flush_interval_s=0.05)
    store = TieredStore(
        [DiskTier.open(tmp_path / "disk", 1 << 24, fsync=False)], observers=[catalog]
    )
    catalog.start()
    catalog.start()  # idempotent
    hashes = chain(9, 3)
    put(store, hashes)
    deadline = time.monotonic() + 10
    while catalog.count_blocks() < 3:
        assert time.monotonic() < deadline, "the flusher never wrote the rows"
        time.sleep(0.02)
    assert catalog.stats().flushes >= 1
    store.writes.delete(hashes)
    while catalog.count_blocks() > 0:
        assert time.monotonic() < deadline, "the flusher never deleted the rows"
        time.sleep(0.02)
    catalog.close()
    store.close()


def test_a_full_queue_wakes_the_flusher_early(make_catalog):
    catalog = make_catalog(flush_interval_s=60.0, max_pending=10)
    catalog.start()
    metas = [meta(i) for i in range(20)]
    for m in metas:
        catalog.block_added(m, "disk", True)
    deadline = time.monotonic() + 10
    while catalog.count_blocks() < 20:
        assert time.monotonic() < deadline, "a full queue did not wake the flusher"
        time.sleep(0.02)


def test_close_flushes_and_stops(migrated):
    catalog = migrated.catalog(flush_interval_s=60.0)
    catalog.start()
    catalog.block_added(meta(1), "disk", True)
    catalog.close()
    catalog.close()  # idempotent
    reader = migrated.catalog()
    assert [r.block_id for r in reader.block_records()] == [meta(1).block_hash]


def test_a_failed_flush_keeps_its_changes(make_catalog, monkeypatch):
    catalog = make_catalog()
    catalog.block_added(meta(1), "disk", True)
    catalog.record_usage("hit_tokens", 5, at=0.0)
    real = catalog._write

    def broken(conn, batch):
        raise RuntimeError("database down")

    monkeypatch.setattr(catalog, "_write", broken)
    with pytest.raises(RuntimeError):
        catalog.flush()
    assert catalog.stats().errors == 1
    # Newer changes queued meanwhile win over the failed batch's, counters add up.
    catalog.block_removed(meta(1).block_hash, "disk", True)
    catalog.block_added(meta(2), "disk", True)
    catalog.record_usage("hit_tokens", 2, at=0.0)
    monkeypatch.setattr(catalog, "_write", real)
    catalog.flush()
    assert [r.block_id for r in catalog.block_records()] == [meta(2).block_hash]
    assert [(u.name, u.value) for u in catalog.usage(0.0, names=["hit_tokens"])] == [
        ("hit_tokens", 7)
    ]


def test_usage_counters_sum_per_bucket(store_and_catalog, clock):
    store, catalog = store_and_catalog
    start = catalog._bucket(clock.now())
    catalog.record_usage("hit_tokens", 10)
    catalog.record_usage("hit_tokens", 6)
    catalog.record_usage("miss_tokens", 4)
    catalog.flush()
    catalog.record_usage("hit_tokens", 1)  # added to the stored value
    clock.advance(3600)
    catalog.record_usage("hit_tokens", 100)
    put(store, chain(10, 2), durable=True)
    got = {(u.name, u.bucket): u.value for u in catalog.usage(start)}
    assert got[("hit_tokens", start)] == 17
    assert got[("miss_tokens", start)] == 4
    assert got[("hit_tokens", start + 3600)] == 100
    assert got[("blocks_added:disk", start + 3600)] == 2
    assert got[("blocks_added:cpu", start + 3600)] == 2
    assert got[("bytes_added:disk", start + 3600)] == 2 * SIZE
    assert [u.value for u in catalog.usage(start + 3600, names=["hit_tokens"])] == [100]
    assert [u.value for u in catalog.usage(start, until=start + 1, names=["hit_tokens"])] == [17]


def test_upsert_and_delete_blocks_directly(make_catalog):
    catalog = make_catalog()
    record = BlockRecord(
        block_id=BlockHash(b"\x01" * 16),
        tier="disk",
        namespace_root=b"\x02" * 16,
        parent=None,
        nbytes=10,
        created=1.0,
        last_access=2.0,
        expires_at=3.0,
        ttl_s=1.0,
        checksum=b"\x00" * 8,
    )
    assert catalog.upsert_blocks([record]) == 1
    assert catalog.block_records() == [record]
    # An upsert without a checksum keeps the known one.
    catalog.upsert_blocks([BlockRecord(**{**_fields(record), "checksum": None, "hit_count": 4})])
    assert catalog.block_records()[0].checksum == b"\x00" * 8
    assert catalog.block_records()[0].hit_count == 4
    assert catalog.lookup_blocks("disk", [record.block_id, BlockHash(b"\x09" * 16)]) == {
        record.block_id: catalog.block_records()[0]
    }
    assert catalog.delete_blocks("disk", [record.block_id]) == 1
    assert catalog.count_blocks() == 0
    catalog.register_namespace(b"\x02" * 16, {"model": "m"})
    assert catalog.namespaces() == {b"\x02" * 16: {"model": "m"}}


def _fields(record: BlockRecord) -> dict:
    return {name: getattr(record, name) for name in record.__dataclass_fields__}


def meta(i: int) -> BlockMeta:
    fields = BlockFields(
        block_hash=BlockHash(i.to_bytes(16, "big")),
        parent=None,
        namespace_root=ROOT,
        nbytes=SIZE,
        ttl_s=60.0,
        created=1.0,
        last_access=1.0,
        expires_at=61.0,
        mask=0b1,
    )
    return BlockMeta.detached(fields, [0])


def test_pin_counts_follow_leases(store_and_catalog):
    store, catalog = store_and_catalog
    hashes = chain(11, 2)
    put(store, hashes, durable=True)
    catalog.flush()
    assert [r.pin_count for r in catalog.block_records()] == [0, 0]
    lease = store.reads.lookup(hashes, lease_s=10).lease
    assert lease is not None
    store.reads.lookup(hashes)  # reports the pins other than its own: the lease's
    catalog.flush()
    assert [r.pin_count for r in catalog.block_records()] == [1, 1]
    store.reads.release(lease.id)
    store.reads.lookup(hashes)
    catalog.flush()
    assert [r.pin_count for r in catalog.block_records()] == [0, 0]
