"""Records are slots that get reused: a handle kept past its record's end, by a call that
runs while another thread drops the block, must not touch whichever block took the slot.
And the review's other findings on the struct-of-arrays index, each as it was found."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import xxhash

from sessioncache.clock import ManualClock
from sessioncache.hashing import BlockHash
from sessioncache.status import BlockStatus
from sessioncache.store import TieredStore
from sessioncache.store.eviction import EvictionPolicy
from sessioncache.store.expiry import ExpiryIndex
from sessioncache.store.index import BlockIndex
from sessioncache.tiers.base import RecoveredBatch, RecoveredBlock
from sessioncache.tiers.cpu import CpuTier, SharedCpuTier

ROOT = b"\x07" * 16
OTHER_ROOT = b"\x08" * 16
SIZE = 4096


def ids(tag: int, n: int) -> list[BlockHash]:
    return [BlockHash(tag.to_bytes(8, "big") + i.to_bytes(8, "big")) for i in range(n)]


def data(h: bytes, size: int = SIZE) -> bytes:
    return np.random.default_rng(list(h)).integers(0, 256, size, dtype=np.uint8).tobytes()


def meanwhile(tier: CpuTier, block: BlockHash, action: Callable[[], None]) -> None:
    """Run ``action`` once, the first time ``tier`` reads ``block`` (as another thread would
    while the store's lock is released for the copy)."""
    real_get = tier.get
    fired: list[int] = []

    def get(block_hash: BlockHash) -> torch.Tensor | None:
        view = real_get(block_hash)
        if block_hash == block and not fired:
            fired.append(1)
            action()
        return view

    tier.get = get  # type: ignore[method-assign]


def test_a_locate_whose_lease_lapses_writes_no_checksum_into_the_slot_reuser() -> None:
    clock = ManualClock()
    tier = SharedCpuTier(16 * SIZE, chunk_bytes=4 * SIZE)
    store = TieredStore([tier], clock=clock)
    [x], [y] = ids(1, 1), ids(2, 1)
    store.writes.put([x], [data(x)], namespace_root=ROOT)
    store.reads.lookup([x], lease_s=1.0)

    def drop_x_and_store_y() -> None:
        clock.advance(2.0)
        store.stats()  # reaps the lapsed lease
        assert store.writes.delete([x]) == 1
        store.writes.put([y], [data(y, 2 * SIZE)], namespace_root=OTHER_ROOT)  # takes x's slot

    meanwhile(tier, x, drop_x_and_store_y)
    assert store.reads.locate([x]) == []  # x went while it was being located
    meta_y = store.reads.meta(y)
    assert meta_y is not None
    assert meta_y.checksum in (None, xxhash.xxh3_64_intdigest(data(y, 2 * SIZE)))


def test_a_copy_for_a_block_dropped_meanwhile_is_not_matched() -> None:
    clock = ManualClock()
    shm = SharedCpuTier(16 * SIZE, chunk_bytes=4 * SIZE)
    low = CpuTier(16 * SIZE, name="low")
    store = TieredStore([shm, low], clock=clock)
    a, x = ids(1, 2)
    store.writes.put([a, x], [data(a), data(x)], namespace_root=ROOT, tier="low")
    store.reads.lookup([a, x], lease_s=1.0)

    def drop_x() -> None:
        clock.advance(2.0)
        store.stats()
        assert store.writes.delete([x]) == 1

    meanwhile(low, x, drop_x)
    store.reads.locate([x])  # copies x up into the shared-memory tier: x is gone by then
    assert store.reads.meta(x) is None
    assert store.reads.lookup([a, x]).hashes == [a]
    assert shm.used_bytes == 0  # the copy made for nothing was taken back


def test_a_block_named_its_own_parent_leaves_no_orphan_when_dropped() -> None:
    store = TieredStore([CpuTier(100 * SIZE)], clock=ManualClock())
    [x], [y] = ids(1, 1), ids(2, 1)
    dropped = store.writes.put([x], [data(x)], namespace_root=ROOT, parent=x)
    assert dropped.status == [BlockStatus.DROPPED]  # its parent (itself) is not held
    assert store.writes.delete([x]) == 0
    assert store._core.index._orphans == {}
    store.writes.put([y], [data(y)], namespace_root=ROOT)  # takes x's slot
    store.writes.put([x], [data(x)], namespace_root=ROOT)  # x anew, a root
    meta = store.reads.meta(x)
    assert meta is not None and meta.children_held == 0


def test_blocks_that_never_expire_are_adopted_on_restart() -> None:
    ExpiryIndex().add_many(["a"], np.array([math.inf]))
    index = BlockIndex(1, EvictionPolicy(1))
    [x] = ids(1, 1)
    found = RecoveredBatch.of([RecoveredBlock(x, ROOT, 64, 0.0, expires_at=math.inf)])
    index.adoption.recovered(found, 0, 0.0, 1.0)
    index.adoption.relink()
    assert index.held(x, 1e12) is not None


def test_an_id_asked_twice_in_one_lookup_counts_two_hits() -> None:
    store = TieredStore([CpuTier(100 * SIZE)], clock=ManualClock())
    a, b = ids(1, 2)
    store.writes.put([a, b], [data(a), data(b)], namespace_root=ROOT)
    assert store.reads.lookup([a, b, a, b]).hashes == [a, b, a, b]
    meta = store.reads.meta(a)
    assert meta is not None and meta.hit_count == 2


def test_namespace_usage_counts_held_blocks_per_root() -> None:
    store = TieredStore([CpuTier(100 * SIZE)], clock=ManualClock())
    assert store.namespace_usage() == {}
    store.writes.put(ids(1, 3), [data(h) for h in ids(1, 3)], namespace_root=ROOT)
    store.writes.put(ids(2, 2), [data(h) for h in ids(2, 2)], namespace_root=OTHER_ROOT)
    assert store.writes.delete(ids(1, 3)[2:]) == 1
    usage = store.namespace_usage()
    assert (usage[ROOT].blocks, usage[ROOT].bytes) == (2, 2 * SIZE)
    assert (usage[OTHER_ROOT].blocks, usage[OTHER_ROOT].bytes) == (2, 2 * SIZE)
