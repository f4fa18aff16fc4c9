"""A staging's blocks are reserved, claimed, published and freed in batches: the store's and
the tier's locks are taken a few times per STAGE or COMMIT, not per block; a COMMIT that fails
part way frees what it held; the tier's map of held blocks keeps one int per block."""

from __future__ import annotations

import gc
import threading
import tracemalloc
from types import TracebackType

import numpy as np
import pytest
import xxhash

from sessioncache.clock import ManualClock
from sessioncache.hashing import BlockHash, Namespace, block_hashes
from sessioncache.status import BlockStatus
from sessioncache.store import TieredStore
from sessioncache.tiers.base import StagedSlot
from sessioncache.tiers.cpu import SharedCpuTier

NS = Namespace("test-model", 4, "float16", "test-layout")
ROOT = NS.root()
SIZE = 1024


class CountingLock:
    """A real lock that counts its acquisitions."""

    def __init__(self, lock: threading.Lock | threading.RLock) -> None:
        self._lock = lock
        self.count = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        self.count += 1
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def chain(seed: int, blocks: int) -> list[BlockHash]:
    rng = np.random.default_rng(seed)
    return block_hashes(NS, rng.integers(0, 50_000, blocks * NS.block_tokens))


def shm_store() -> tuple[TieredStore, SharedCpuTier]:
    tier = SharedCpuTier(1024 * SIZE, chunk_bytes=256 * SIZE)
    return TieredStore([tier], clock=ManualClock(1_000.0)), tier


def fill(i: int, slot: StagedSlot) -> int:
    slot.payload.fill_(i % 251)
    return xxhash.xxh3_64_intdigest(bytes([i % 251]) * SIZE)


def test_a_64_block_stage_and_commit_take_each_lock_a_few_times():
    store, tier = shm_store()
    hashes = chain(1, 64)
    store.writes.put(hashes[:4], [bytes(SIZE)] * 4, namespace_root=ROOT)  # 4 held already
    core_lock = store._core.lock = CountingLock(store._core.lock)  # type: ignore[assignment]
    tier_lock = tier._lock = CountingLock(tier._lock)  # type: ignore[assignment]
    write = store.writes.stage(hashes, namespace_root=ROOT, nbytes=SIZE)
    assert write.status == [BlockStatus.PRESENT] * 4 + [BlockStatus.STORED] * 60
    sums = [fill(i, s) if s is not None else 0 for i, s in enumerate(write.slots)]
    result = store.writes.commit(write, sums)
    assert result.stored == hashes[4:] and result.present == hashes[:4]
    assert core_lock.count < 16 and tier_lock.count < 8, (core_lock.count, tier_lock.count)
    assert store.reads.lookup(hashes).hashes == hashes
    assert store.stats().pinned_blocks == 0 and tier.used_bytes == 64 * SIZE


def test_a_commit_whose_copy_fails_frees_every_block_of_it():
    store, tier = shm_store()
    hashes = chain(2, 4)
    write = store.writes.stage(hashes, namespace_root=ROOT, nbytes=SIZE)

    def copy_in(i: int, slot: StagedSlot) -> int:
        if i == 2:
            raise OSError("the writer's staging memory is gone")
        return fill(i, slot)

    sums = [xxhash.xxh3_64_intdigest(bytes([i]) * SIZE) for i in range(4)]
    with pytest.raises(OSError):
        store.writes.commit(write, sums, copy_in=copy_in)
    store.writes.abort(write)
    assert tier.used_bytes == 0 and store.stats().pinned_blocks == 0
    assert store.stats().blocks == 0 and not store.reads.lookup(hashes).hashes


def test_the_tier_keeps_one_int_per_held_block():
    tier = SharedCpuTier(8192 * 64, chunk_bytes=8192 * 64)
    tier.release_many(tier.reserve_many(64, 1))  # the chunk is made before the count
    hashes = [i.to_bytes(16, "big") for i in range(4096)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for at in range(0, len(hashes), 64):  # as stagings come: 64 blocks at a time
            slots = tier.reserve_many(64, 64)
            assert tier.publish_many(list(zip(hashes[at : at + 64], slots, strict=True))) == [
                True
            ] * len(slots)
        del slots
        gc.collect()
        per_block = (tracemalloc.get_traced_memory()[0] - before) / len(hashes)
    finally:
        tracemalloc.stop()
    # a dict entry (~40 B here) and one int (32 B); a slot object per block cost ~56 B more
    assert per_block < 100, per_block
    assert len(tier) == len(hashes) and tier.get(hashes[-1]) is not None
    tier.close()
