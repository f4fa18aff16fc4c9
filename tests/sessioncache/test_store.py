"""The tiered store: lookup, placement, demotion, promotion, leases, TTL, bad input, threads."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

from sessioncache.clock import ManualClock
from sessioncache.errors import (
    BlockNotFound,
    InvalidInput,
    LeaseNotFound,
    PayloadSizeError,
    UnknownTier,
)
from sessioncache.hashing import BlockHash, Namespace, block_hashes
from sessioncache.store import DEFAULT_TTL_S, TieredStore
from sessioncache.tiers.cpu import CpuTier
from sessioncache.tiers.gpu import GpuTier

NS = Namespace("test-model", 4, "float16", "test-layout")
ROOT = NS.root()
SIZE = 64
DAY = 86400.0


def chain(seed: int, blocks: int) -> list[BlockHash]:
    rng = np.random.default_rng(seed)
    return block_hashes(NS, rng.integers(0, 50_000, blocks * NS.block_tokens))


def data(h: bytes, size: int = SIZE) -> bytes:
    return (h * (size // 16 + 1))[:size]


def put(store: TieredStore, hashes: list[BlockHash], **kw: object) -> None:
    store.writes.put(hashes, [data(h) for h in hashes], namespace_root=ROOT, **kw)  # type: ignore[arg-type]


def one_tier(blocks: int, clock: ManualClock) -> TieredStore:
    return TieredStore([CpuTier(blocks * SIZE)], clock=clock)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def test_lookup_returns_longest_held_prefix_with_tiers(clock: ManualClock):
    store = TieredStore([GpuTier(10 * SIZE, device="cpu"), CpuTier(10 * SIZE)], clock=clock)
    hashes = chain(1, 6)
    put(store, hashes[:4])
    match = store.reads.lookup(hashes)
    assert match.hashes == hashes[:4] and match.num_blocks == 4
    assert match.tiers == ["gpu"] * 4 and match.lease is None
    assert store.reads.lookup(chain(2, 3)).hashes == []
    # A hole stops the match even if later blocks are held.
    store.writes.delete([hashes[1]])
    assert store.reads.lookup(hashes).hashes == hashes[:1]


def test_get_returns_exact_bytes_and_unknown_raises(clock: ManualClock):
    store = one_tier(4, clock)
    hashes = chain(1, 2)
    put(store, hashes)
    assert bytes(store.reads.get(hashes[1]).numpy()) == data(hashes[1])
    with pytest.raises(BlockNotFound):
        store.reads.get(chain(9, 1)[0])


def test_lru_eviction_order_is_exact_and_tail_first(clock: ManualClock):
    store = one_tier(5, clock)
    a, b = chain(1, 3), chain(2, 2)
    put(store, a)  # t=0
    clock.advance(10)
    put(store, b)  # t=10
    clock.advance(10)
    store.reads.lookup(a)  # t=20: A is now the most recent
    clock.advance(10)
    order = []
    for i, h in enumerate(chain(3, 5)):
        before = set(store.tiers[0].keys())
        store.writes.put([h], [data(h)], namespace_root=ROOT, parent=None)
        clock.advance(1)
        order.extend(before - set(store.tiers[0].keys()))
        assert len(order) == i + 1
    assert order == [b[1], b[0], a[2], a[1], a[0]]


def test_a_parent_outlives_its_child_even_when_older(clock: ManualClock):
    store = one_tier(3, clock)
    parent, child = chain(1, 2)
    put(store, [parent])
    clock.advance(100)
    store.writes.put([child], [data(child)], namespace_root=ROOT, parent=parent)
    clock.advance(100)
    other = chain(2, 1)
    put(store, other)
    clock.advance(1)
    filler = chain(3, 1)
    put(store, filler)  # evicts the child (tail) before its older parent
    assert store.reads.where(child) == [] and store.reads.where(parent) == ["cpu"]


def test_expired_blocks_go_before_lru_order(clock: ManualClock):
    store = one_tier(3, clock)
    old, short = chain(1, 1), chain(2, 1)
    put(store, old, ttl_s=10 * DAY)
    clock.advance(10)
    put(store, short, ttl_s=60)
    clock.advance(10)
    put(store, chain(3, 1))
    clock.advance(100)  # short has expired; old is older but alive
    put(store, chain(4, 1))
    assert store.reads.where(short[0]) == [] and store.reads.where(old[0]) == ["cpu"]
    assert store.stats().counters.expirations == 1


def test_ttl_sliding_expiry_over_days(clock: ManualClock):
    store = one_tier(8, clock)
    hashes = chain(1, 3)
    put(store, hashes)
    clock.advance(2 * DAY)
    assert store.reads.lookup(hashes).num_blocks == 3  # idle two days: still there, TTL slides
    clock.advance(DEFAULT_TTL_S - 1)
    assert store.reads.lookup(hashes).num_blocks == 3
    clock.advance(DEFAULT_TTL_S + 1)
    assert store.reads.lookup(hashes).num_blocks == 0
    assert store.writes.expire() == 3
    assert store.stats().blocks == 0 and store.tiers[0].used_bytes == 0


def test_lookup_ttl_raises_block_ttl_to_at_least_that(clock: ManualClock):
    store = one_tier(8, clock)
    hashes = chain(1, 2)
    put(store, hashes, ttl_s=3600)
    store.reads.lookup(hashes, ttl_s=7 * DAY)
    clock.advance(6 * DAY)
    assert store.reads.lookup(hashes).num_blocks == 2
    store.reads.lookup(hashes, ttl_s=60)  # a shorter TTL never shortens a block's life
    clock.advance(6 * DAY)
    assert store.reads.lookup(hashes).num_blocks == 2


def test_touch_slides_the_held_prefix_without_counting_a_lookup(clock: ManualClock):
    store = one_tier(8, clock)
    hashes = chain(1, 4)
    put(store, hashes[:3], ttl_s=DAY)
    clock.advance(0.9 * DAY)
    before = store.counters()
    assert store.reads.touch(hashes, ttl_s=2 * DAY) == 3
    assert store.counters() == before
    meta = store.reads.meta(hashes[0])
    assert meta is not None and meta.hit_count == 0 and meta.last_access == clock.now()
    clock.advance(1.5 * DAY)  # past the TTL they were stored with, within the touched one
    assert store.reads.lookup(hashes).num_blocks == 3


def test_lease_pins_until_released_and_pinned_blocks_are_never_evicted(clock: ManualClock):
    store = one_tier(3, clock)
    hashes = chain(1, 3)
    put(store, hashes)
    match = store.reads.lookup(hashes, lease_s=30)
    assert match.lease is not None and match.lease.expires_at == clock.now() + 30
    newcomer = chain(2, 1)
    result = store.writes.put(newcomer, [data(newcomer[0])], namespace_root=ROOT)
    assert result.dropped == newcomer  # never raises; nothing could be evicted
    assert store.reads.lookup(hashes).num_blocks == 3
    store.reads.release(match.lease.id)
    with pytest.raises(LeaseNotFound):
        store.reads.release(match.lease.id)
    result = store.writes.put(newcomer, [data(newcomer[0])], namespace_root=ROOT)
    assert result.stored == newcomer


def test_lease_expires_with_the_clock(clock: ManualClock):
    store = one_tier(2, clock)
    hashes = chain(1, 2)
    put(store, hashes)
    lease = store.reads.lookup(hashes, lease_s=5).lease
    assert lease is not None and store.stats().pinned_blocks == 2
    clock.advance(6)
    assert store.stats().pinned_blocks == 0 and store.stats().leases == 0
    with pytest.raises(LeaseNotFound):
        store.reads.release(lease.id)


def test_demotion_moves_victims_down_and_the_last_tier_drops(clock: ManualClock):
    store = TieredStore(
        [GpuTier(2 * SIZE, device="cpu"), CpuTier(2 * SIZE)], clock=clock, promote_on_get=False
    )
    blocks = [chain(i, 1)[0] for i in range(5)]
    for h in blocks:
        put(store, [h])
        clock.advance(1)
    assert [store.reads.where(h) for h in blocks] == [[], ["cpu"], ["cpu"], ["gpu"], ["gpu"]]
    stats = store.stats()
    assert stats.counters.demotions == 3 and stats.counters.evictions == 4
    for h in blocks[1:]:
        assert bytes(store.reads.get(h).numpy()) == data(h)


def test_a_long_new_chain_keeps_its_head_in_the_fast_tier(clock: ManualClock):
    store = TieredStore([GpuTier(3 * SIZE, device="cpu"), CpuTier(4 * SIZE)], clock=clock)
    hashes = chain(1, 10)
    result = store.writes.put(hashes, [data(h) for h in hashes], namespace_root=ROOT)
    assert result.stored == hashes[:7] and result.dropped == hashes[7:]
    assert store.reads.lookup(hashes).tiers == ["gpu"] * 3 + ["cpu"] * 4


def test_get_promotes_a_lower_tier_hit(clock: ManualClock):
    store = TieredStore([GpuTier(1 * SIZE, device="cpu"), CpuTier(4 * SIZE)], clock=clock)
    a, b = chain(1, 1), chain(2, 1)
    put(store, a)
    clock.advance(1)
    put(store, b)
    assert store.reads.where(a[0]) == ["cpu"]
    clock.advance(1)
    assert bytes(store.reads.get(a[0]).numpy()) == data(a[0])
    assert store.reads.where(a[0])[0] == "gpu" and store.reads.where(b[0]) == ["cpu"]
    assert store.stats().counters.promotions == 1


def test_a_load_under_a_lease_costs_the_tier_below_no_other_tenants_chain(clock: ManualClock):
    """An engine loading a chain from the lower tier promotes it under its lease. The lease
    holds the blocks, not each copy: once a faster tier holds them, their copies below are
    spare and go first when room is needed there (as an exclusive LRU stack would have moved
    them up), not another tenant's chain."""
    store = TieredStore([CpuTier(3 * SIZE), CpuTier(6 * SIZE, name="disk")], clock=clock)
    other = Namespace("test-model", 4, "float16", "test-layout", salt="tenant-b")
    mine = chain(1, 3)
    theirs = block_hashes(other, np.random.default_rng(2).integers(0, 50_000, 12))
    put(store, mine)
    clock.advance(1)
    store.writes.put(theirs, [data(h) for h in theirs], namespace_root=other.root())
    assert [store.reads.where(h) for h in mine + theirs] == [["disk"]] * 3 + [["cpu"]] * 3
    match = store.reads.lookup(mine, lease_s=30)
    for h in mine:
        store.reads.get(h)  # the engine's load: promoted, theirs pushed down
    assert [store.reads.where(h) for h in theirs] == [["disk"]] * 3
    put(store, chain(3, 3))  # the fast tier is all leased: into the tier below
    assert store.reads.lookup(theirs).num_blocks == 3
    assert [store.reads.where(h) for h in mine] == [["cpu"]] * 3  # still held, leased
    assert store.reads.lookup(chain(3, 3)).num_blocks == 3
    assert match.lease is not None
    store.reads.release(match.lease.id)


def test_put_extends_ttl_of_held_blocks_and_reports_them(clock: ManualClock):
    store = one_tier(4, clock)
    hashes = chain(1, 2)
    put(store, hashes, ttl_s=100)
    clock.advance(50)
    result = store.writes.put(hashes, [data(h) for h in hashes], namespace_root=ROOT, ttl_s=100)
    assert result.present == hashes and result.stored == []
    clock.advance(90)
    assert store.reads.lookup(hashes).num_blocks == 2


def test_bad_input_raises_and_writes_nothing(clock: ManualClock):
    store = one_tier(8, clock)
    hashes = chain(1, 3)
    put(store, hashes[:1])
    cases: list[tuple[type[Exception], dict[str, object]]] = [
        (PayloadSizeError, {"payloads": [data(h, SIZE + 1) for h in hashes]}),
        (PayloadSizeError, {"payloads": [data(hashes[0]), data(hashes[1], 8), data(hashes[2])]}),
        (PayloadSizeError, {"payloads": [b"", b"", b""]}),
        (UnknownTier, {"tier": "nvme"}),
        (InvalidInput, {"ttl_s": -1}),
        (InvalidInput, {"ttl_s": 0}),
        (InvalidInput, {"payloads": [data(hashes[0])]}),
        (InvalidInput, {"hashes": [b"short", *hashes[1:]]}),
        (InvalidInput, {"namespace_root": b"x"}),
        (InvalidInput, {"durable": True}),
    ]
    for exc, override in cases:
        kwargs: dict[str, object] = {
            "hashes": hashes,
            "payloads": [data(h) for h in hashes],
            "namespace_root": ROOT,
        }
        kwargs.update(override)
        with pytest.raises(exc):
            store.writes.put(**kwargs)  # type: ignore[arg-type]
        assert store.stats().blocks == 1 and store.tiers[0].used_bytes == SIZE
    with pytest.raises(InvalidInput):
        store.reads.lookup(hashes, lease_s=-1)
    with pytest.raises(InvalidInput):
        store.reads.lookup(hashes, ttl_s=-5)
    with pytest.raises(InvalidInput):
        TieredStore([CpuTier(10), CpuTier(10)])
    with pytest.raises(InvalidInput):
        TieredStore([])


def test_exceeding_total_capacity_never_raises(clock: ManualClock):
    store = TieredStore([GpuTier(4 * SIZE, device="cpu"), CpuTier(4 * SIZE)], clock=clock)
    for i in range(50):
        put(store, chain(i, 3))
        clock.advance(1)
    stats = store.stats()
    assert [t.used_bytes for t in stats.tiers] == [4 * SIZE, 4 * SIZE]
    assert stats.blocks == 8


def test_payload_tensors_of_any_dtype_are_accepted(clock: ManualClock):
    store = one_tier(4, clock)
    h = chain(1, 1)
    tensor = torch.arange(16, dtype=torch.float32)
    store.writes.put(h, [tensor], namespace_root=ROOT)
    assert torch.equal(store.reads.get(h[0]).view(torch.float32), tensor)


def test_concurrent_put_get_lookup_and_eviction_lose_and_corrupt_nothing():
    """Four threads store and read overlapping chains through two small tiers. Every read must
    return the block's own bytes, leases must hold, and the books must balance at the end."""
    store = TieredStore([GpuTier(40 * SIZE, device="cpu"), CpuTier(60 * SIZE)])
    chains = [chain(i, 6) for i in range(40)]
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                hashes = rng.choice(chains)
                op = rng.random()
                if op < 0.4:
                    put(store, hashes)
                elif op < 0.9:
                    match = store.reads.lookup(hashes, lease_s=10)
                    for h in match.hashes:
                        assert bytes(store.reads.get(h).numpy()) == data(h)
                    if match.lease is not None:
                        store.reads.release(match.lease.id)
                else:
                    store.writes.delete(hashes[-2:])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    stats = store.stats()
    assert stats.pinned_blocks == 0 and stats.leases == 0
    for tier, tier_stats in zip(store.tiers, stats.tiers, strict=True):
        assert tier.used_bytes == SIZE * len(tier.keys()) == SIZE * tier_stats.blocks
        assert tier.used_bytes <= tier.capacity_bytes
    for hashes in chains:
        for h in store.reads.lookup(hashes).hashes:
            assert bytes(store.reads.get(h).numpy()) == data(h)


# -- regressions found by the trace replay ---------------------------------------------------


def test_put_stops_at_the_first_dropped_block(clock: ManualClock):
    """Blocks after a dropped one are unreachable: storing them would only evict others."""
    store = one_tier(3, clock)
    pinned = chain(1, 2)
    put(store, pinned)
    store.reads.pin(pinned)
    clock.advance(1)
    hashes = chain(2, 3)
    result = store.writes.put(hashes, [data(h) for h in hashes], namespace_root=ROOT)
    assert result.stored == hashes[:1] and result.dropped == hashes[1:]
    assert store.reads.lookup(pinned).num_blocks == 2 and store.reads.where(hashes[0]) == ["cpu"]


def test_put_never_evicts_the_incoming_blocks_own_parent(clock: ManualClock):
    store = one_tier(3, clock)
    prefix = chain(1, 4)
    put(store, prefix[:3])
    clock.advance(10)
    match = store.reads.lookup(prefix)  # the engine reads the prefix, then stores its suffix
    result = store.writes.put(
        prefix[3:], [data(prefix[3])], namespace_root=ROOT, parent=match.hashes[-1]
    )
    assert result.dropped == prefix[3:]
    assert store.reads.lookup(prefix).num_blocks == 3


def test_the_last_copy_of_a_parent_outlives_its_children_in_other_tiers(clock: ManualClock):
    """Chains are evicted tail first across tiers too: a parent whose only copy is on the
    last tier is not dropped while a child of it is held in a faster tier."""
    store = TieredStore(
        [GpuTier(1 * SIZE, device="cpu"), CpuTier(2 * SIZE)], clock=clock, promote_on_get=False
    )
    parent, child = chain(1, 2)
    put(store, [parent])
    clock.advance(1)
    other = chain(2, 1)
    put(store, other)  # parent demoted to the last tier
    clock.advance(1)
    store.writes.put([child], [data(child)], namespace_root=ROOT, parent=parent, tier="gpu")
    assert store.reads.where(parent) == ["cpu"] and store.reads.where(child) == ["gpu"]
    clock.advance(1)
    for i in range(3):  # pressure on the last tier: the parent is older than everything
        h = chain(10 + i, 1)
        store.writes.put(h, [data(h[0])], namespace_root=ROOT, tier="cpu")
        clock.advance(1)
    assert store.reads.lookup([parent, child]).num_blocks == 2


def test_a_parent_stored_again_counts_the_children_that_outlived_it(clock: ManualClock):
    """A record made anew while its children are held starts from them: otherwise the count
    goes negative when they leave, and its last copy can never be evicted again."""
    store = one_tier(2, clock)
    parent, child = chain(1, 2)
    store.writes.put([parent], [data(parent)], namespace_root=ROOT, ttl_s=10)
    store.writes.put([child], [data(child)], namespace_root=ROOT, parent=parent, ttl_s=100)
    clock.advance(20)
    assert store.writes.expire() == 1 and store.reads.where(child) == [
        "cpu"
    ]  # the parent expired alone
    put(store, [parent])
    store.writes.delete([child])
    clock.advance(1)
    other = chain(2, 2)
    put(store, other)
    assert store.reads.where(parent) == [] and store.reads.lookup(other).num_blocks == 2


def test_a_demoted_block_is_admitted_below_even_when_colder(clock: ManualClock):
    """Refusing a demoted block below drops it, orphaning its tail held there."""
    store = TieredStore([GpuTier(1 * SIZE, device="cpu"), CpuTier(2 * SIZE)], clock=clock)
    head = chain(1, 2)
    put(store, head)  # the head in the fast tier, its tail below
    assert store.reads.where(head[0]) == ["gpu"] and store.reads.where(head[1]) == ["cpu"]
    clock.advance(1)
    other = chain(2, 1)
    put(store, other, tier="cpu")
    clock.advance(1)
    store.reads.get(head[1], promote=False)  # everything below is now hotter than the head
    clock.advance(1)
    put(store, chain(3, 1))  # demotes the head
    assert store.reads.lookup(head).num_blocks == 2 and store.reads.where(other[0]) == []


def test_spare_copies_below_go_first_even_when_pinned_by_a_session(clock: ManualClock):
    store = TieredStore([GpuTier(1 * SIZE, device="cpu"), CpuTier(2 * SIZE)], clock=clock)
    old, hot = chain(1, 1), chain(2, 1)
    put(store, old, tier="cpu")
    clock.advance(1)
    put(store, hot, tier="cpu")
    clock.advance(1)
    store.reads.get(hot[0])  # promoted: its copy below is spare
    store.reads.pin(hot)
    assert store.reads.where(hot[0]) == ["gpu", "cpu"]
    clock.advance(1)
    new = chain(3, 1)
    put(store, new, tier="cpu")
    assert store.reads.where(hot[0]) == ["gpu"] and store.reads.where(old[0]) == ["cpu"]
    assert store.reads.where(new[0]) == ["cpu"]


def test_a_block_is_stored_no_faster_than_its_parent(clock: ManualClock):
    store = TieredStore([GpuTier(2 * SIZE, device="cpu"), CpuTier(4 * SIZE)], clock=clock)
    parent, child = chain(1, 2)
    put(store, [parent], tier="cpu")
    store.writes.put([child], [data(child)], namespace_root=ROOT, parent=parent)
    assert store.reads.where(child) == ["cpu"]


def test_the_eviction_heaps_stay_in_proportion_to_the_candidates():
    """Every block of a stored chain is its tail for an instant; the stale entries that
    leaves are compacted away instead of piling up per block held (issue 15)."""
    store = TieredStore([CpuTier(1 << 30)])
    chain = 512
    for number in range(64):
        ids = [BlockHash(number.to_bytes(8, "big") + i.to_bytes(8, "big")) for i in range(chain)]
        store.writes.put(ids, [b"\x01" * 64] * chain, namespace_root=b"\x02" * 16)
    policy = store._core.policy
    assert policy.queued(0) <= 3 * 4096 + 64 * 3  # not ~2 entries for each of 32K blocks
