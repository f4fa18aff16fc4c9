"""Chunks made ahead of need (``spare_chunks``) or all at start (``preallocate``): a put that
needs a new chunk takes a ready one, spares never take a tier over its capacity, and they
are given back at close."""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest

from sessioncache.errors import TierFull
from sessioncache.hashing import BlockHash
from sessioncache.tiers.base import PutItem
from sessioncache.tiers.cpu import CpuTier, SharedCpuTier
from sessioncache.tiers.spares import SparePool

NS = b"\x04" * 16
CHUNK = 4096


def bid(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def wait_for(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def own_memfds(tag: str) -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += tag in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
    return count


def test_spares_are_made_after_the_first_chunk_and_taken_by_the_next():
    tier = SharedCpuTier(8 * CHUNK, chunk_bytes=CHUNK, spare_chunks=2, grow_chunks=False)
    assert tier.spare_bytes == 0  # an unused tier holds no memory
    for i in range(4):  # 1 KiB blocks: one chunk
        tier.put(PutItem(bid(i), bytes([i]) * 1024, NS))
    wait_for(lambda: tier.spare_bytes == 2 * CHUNK)
    assert tier.segments() == [1]  # spares are not live segments: nothing in them
    tier.put(PutItem(bid(4), b"\x04" * 1024, NS))  # needs a new chunk: a spare, made before
    assert len(tier.segments()) == 2 and max(tier.segments()) in (2, 3)
    wait_for(lambda: tier.spare_bytes == 2 * CHUNK)  # refilled
    for i in range(5):
        got = tier.get(bid(i))
        assert got is not None and bytes(got.numpy()) == bytes([i]) * 1024
    tier.close()


def test_spares_never_take_the_tier_over_its_capacity():
    tier = SharedCpuTier(3 * CHUNK, chunk_bytes=CHUNK, spare_chunks=5, grow_chunks=False)
    tier.put(PutItem(bid(0), b"\x00" * 1024, NS))
    wait_for(lambda: tier.spare_bytes == 2 * CHUNK)
    time.sleep(0.05)
    assert tier.spare_bytes + tier.allocated_bytes == 3 * CHUNK
    for i in range(1, 12):
        tier.put(PutItem(bid(i), bytes([i]) * 1024, NS))
    assert tier.allocated_bytes == 3 * CHUNK and tier.spare_bytes == 0
    with pytest.raises(TierFull):
        tier.put(PutItem(bid(99), b"\x09" * 1024, NS))
    tier.close()


def test_a_block_bigger_than_a_chunk_drops_spares_to_make_room():
    tier = CpuTier(4 * CHUNK, chunk_bytes=CHUNK, spare_chunks=3, grow_chunks=False)
    tier.put(PutItem(bid(0), b"\x00" * 1024, NS))
    wait_for(lambda: tier.spare_bytes == 3 * CHUNK)
    tier.put(PutItem(bid(1), b"\x01" * (2 * CHUNK), NS))  # one slot of two chunks' size, made now
    got = tier.get(bid(1))
    assert got is not None and bytes(got.numpy()) == b"\x01" * (2 * CHUNK)
    assert tier.allocated_bytes == 3 * CHUNK and tier.spare_bytes <= CHUNK
    tier.close()


@pytest.mark.parametrize("cls", [CpuTier, SharedCpuTier])
def test_preallocate_makes_every_chunk_at_construction(cls: type[CpuTier]) -> None:
    tier = cls(4 * CHUNK + 100, chunk_bytes=CHUNK, preallocate=True)
    assert tier.spare_bytes == 4 * CHUNK and tier.allocated_bytes == 0
    for i in range(16):
        tier.put(PutItem(bid(i), bytes([i]) * 1024, NS))
    assert tier.spare_bytes == 0 and tier.allocated_bytes == 4 * CHUNK
    if isinstance(tier, SharedCpuTier):
        assert tier.segments() == [1, 2, 3, 4]  # the ones made at start, none since
    for i in range(16):
        got = tier.get(bid(i))
        assert got is not None and bytes(got.numpy()) == bytes([i]) * 1024
    tier.close()


def test_close_and_a_dropped_tier_give_the_spares_descriptors_back():
    tier = SharedCpuTier(4 * CHUNK, chunk_bytes=CHUNK, preallocate=True, name="sparetest")
    assert own_memfds("sessioncache-sparetest-") == 4 * 2  # descriptor + mapping each
    tier.close()
    gc.collect()
    assert own_memfds("sessioncache-sparetest-") == 0
    dropped = SharedCpuTier(4 * CHUNK, chunk_bytes=CHUNK, preallocate=True, name="sparedrop")
    dropped.put(PutItem(bid(1), b"\x01" * 1024, NS))
    del dropped
    gc.collect()
    assert own_memfds("sessioncache-sparedrop-") == 0


def test_a_put_waits_for_the_spare_being_made_instead_of_making_another():
    gate = threading.Event()
    made: list[tuple[int, bool]] = []

    class Maker:
        def make(self, nbytes: int, ahead: bool) -> bytearray:
            made.append((nbytes, ahead))
            if ahead:
                gate.wait(10)
            return bytearray(nbytes)

    maker = Maker()
    pool: SparePool[bytearray] = SparePool(
        maker.make, lambda m: None, chunk_bytes=100, capacity_bytes=1000, target=1, name="t"
    )
    pool.start()
    wait_for(lambda: made == [(100, True)])
    taken: list[int] = []
    taker = threading.Thread(target=lambda: taken.append(pool.take(100)[1]))
    taker.start()
    time.sleep(0.05)
    assert not taken  # waiting for the spare being made
    gate.set()
    taker.join(10)
    assert taken == [100] and made[0] == (100, True)
    assert (100, False) not in made  # nothing made in the taker's thread
    wait_for(lambda: pool.spare_count == 1)  # refilled
    assert pool.held_bytes == 200
    pool.give_back(100)
    assert pool.held_bytes == 100
    pool.close()
    assert pool.held_bytes == 0 and pool.spare_count == 0


def test_a_failed_spare_leaves_the_chunk_to_be_made_when_needed():
    calls: list[bool] = []

    class Maker:
        def make(self, nbytes: int, ahead: bool) -> bytearray:
            calls.append(ahead)
            if ahead:
                raise OSError("no memory")
            return bytearray(nbytes)

    maker = Maker()
    pool: SparePool[bytearray] = SparePool(
        maker.make, lambda m: None, chunk_bytes=100, capacity_bytes=1000, target=1, name="t"
    )
    pool.start()
    wait_for(lambda: calls == [True])
    wait_for(lambda: pool.held_bytes == 0)
    memory, size = pool.take(100)
    assert len(memory) == 100 and size == 100 and False in calls
    pool.close()


def test_chunks_grow_from_one_slot_so_many_sizes_cannot_squat_the_tier() -> None:
    tier = CpuTier(8 * CHUNK, chunk_bytes=CHUNK)
    for i in range(4):  # one block each of four sizes: the first a whole chunk, then slots
        tier.put(PutItem(bid(i), b"s" * (100 + i), NS))
    first = (CHUNK // 100) * 100
    assert tier.allocated_bytes == first + sum(100 + i for i in range(1, 4))
    for i in range(64):  # a fifth size grows 1, 1, 2, 4, ... slots, up to a chunk
        tier.put(PutItem(bid(100 + i), bytes([i]) * 256, NS))
    assert tier.allocated_bytes - first - 306 <= 2 * 64 * 256
    sizes = sorted({c.tensor.shape[0] for c in tier._slabs[256].chunks if c is not None})
    assert sizes[0] == 1 and max(sizes) <= CHUNK // 256
    tier.close()


@pytest.mark.parametrize("cls", [CpuTier, SharedCpuTier])
def test_make_ahead_makes_the_spares_in_the_background_without_any_put(
    cls: type[CpuTier],
) -> None:
    tier = cls(8 * CHUNK, chunk_bytes=CHUNK, spare_chunks=8, grow_chunks=False)
    assert tier.spare_bytes == 0
    tier.make_ahead()
    wait_for(lambda: tier.spare_bytes == 8 * CHUNK)  # the whole tier, no put
    assert tier.allocated_bytes == 0
    if isinstance(tier, SharedCpuTier):
        assert tier.segments() == []  # made ahead, not live: nothing in them yet
    for i in range(8 * 4):
        tier.put(PutItem(bid(i), bytes([i]) * 1024, NS))
    assert tier.spare_bytes == 0 and tier.allocated_bytes == 8 * CHUNK
    if isinstance(tier, SharedCpuTier):
        assert tier.segments() == list(range(1, 9))  # only the ones made ahead
    tier.close()
