"""The CPU tier in shared memory: memfd segments another mapping sees, slots filled in place,
sealed sizes, no name anywhere in the file system."""

from __future__ import annotations

import gc
import mmap
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from sessioncache.errors import PayloadSizeError, TierFull
from sessioncache.hashing import BlockHash
from sessioncache.tiers.base import PutItem, SharedMemoryTier, Tier
from sessioncache.tiers.cpu import CpuTier, SharedCpuTier
from sessioncache.tiers.gpu import GpuTier

NS = b"\x03" * 16


def bid(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def mapping(tier: SharedCpuTier, segment: int) -> mmap.mmap:
    """The segment as another process maps it: from a descriptor the tier hands out, read-only
    (the tier's seal refuses any other mapping a writable one)."""
    fd = tier.segment_fd(segment)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, os.fstat(fd).st_size)
        return mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def test_only_the_shared_tier_is_a_shared_memory_tier():
    tier = SharedCpuTier(4096)
    assert isinstance(tier, SharedMemoryTier) and isinstance(tier, Tier)
    assert not isinstance(CpuTier(4096), SharedMemoryTier)
    assert not isinstance(GpuTier(4096, device="cpu"), SharedMemoryTier)
    tier.close()


def test_a_block_is_where_locate_says_in_another_mapping():
    tier = SharedCpuTier(1 << 20, chunk_bytes=4000, grow_chunks=False)
    for i in range(12):  # 1000-byte blocks, 4 per chunk: three segments
        tier.put(PutItem(bid(i), bytes([i]) * 1000, NS))
    assert tier.segments() == [1, 2, 3]
    maps = {s: mapping(tier, s) for s in tier.segments()}
    for i in range(12):
        where = tier.locate(bid(i))
        assert where is not None and where.nbytes == 1000
        assert maps[where.segment][where.offset : where.offset + 1000] == bytes([i]) * 1000
    assert tier.locate(bid(99)) is None
    tier.close()


def test_a_reserved_slot_is_invisible_until_published_and_then_not_copied():
    tier = SharedCpuTier(1 << 20, chunk_bytes=8192, grow_chunks=False)
    slot = tier.reserve(1000)
    assert tier.used_bytes == 1000 and len(tier._reserved) == 1
    slot.payload.numpy()[:] = 9  # the node's writer (its copy of what a client staged)
    assert tier.get(bid(1)) is None and tier.locate(bid(1)) is None and tier.keys() == []
    assert tier.publish_many([(bid(1), slot)])[0]
    assert tier.locate(bid(1)) == slot.location and len(tier._reserved) == 0
    got = tier.get(bid(1))
    assert got is not None and bytes(got.numpy()) == b"\x09" * 1000
    assert got.data_ptr() == slot.payload.data_ptr()  # the slot itself became the block
    tier.close()


def test_publishing_a_held_id_frees_the_slot_and_keeps_the_held_bytes():
    tier = SharedCpuTier(1 << 20)
    tier.put(PutItem(bid(1), b"\x01" * 100, NS))
    slot = tier.reserve(100)
    slot.payload.numpy()[:] = 2
    assert not tier.publish_many([(bid(1), slot)])[0]
    assert tier.used_bytes == 100 and len(tier._reserved) == 0
    got = tier.get(bid(1))
    assert got is not None and bytes(got.numpy()) == b"\x01" * 100
    with pytest.raises(KeyError):
        tier.publish_many([(bid(2), slot)])[0]  # no longer reserved
    tier.close()


def test_released_slots_are_reused_and_reservations_respect_capacity():
    tier = SharedCpuTier(3000, chunk_bytes=3000, grow_chunks=False)
    slots = [tier.reserve(1000) for _ in range(3)]
    with pytest.raises(TierFull):
        tier.reserve(1000)
    with pytest.raises(PayloadSizeError):
        tier.reserve(0)
    with pytest.raises(PayloadSizeError):
        tier.reserve(3001)
    tier.release_many([slots[1]])
    tier.release_many([slots[1]])  # twice: a no-op
    assert tier.used_bytes == 2000
    again = tier.reserve(1000)
    assert again.location == slots[1].location
    tier.close()


def test_segment_sizes_are_sealed_against_peers():
    tier = SharedCpuTier(1 << 20, chunk_bytes=4096, grow_chunks=False)
    tier.put(PutItem(bid(1), b"\x01" * 1024, NS))
    fd = tier.segment_fd(1)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)  # would SIGBUS the node on its next access
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 1 << 30)
    finally:
        os.close(fd)
    tier.close()


def test_a_reclaimed_chunk_retires_its_segment_and_ids_are_not_reused():
    tier = SharedCpuTier(1000, chunk_bytes=1000, grow_chunks=False)
    for i in range(10):
        tier.put(PutItem(bid(i), b"\x00" * 100, NS))
    assert tier.segments() == [1]
    for i in range(10):
        tier.delete(bid(i))
    tier.put(PutItem(bid(100), b"\x05" * 500, NS))  # another size: the idle chunk is reclaimed
    assert tier.segments() == [2]
    with pytest.raises(KeyError):
        tier.segment_fd(1)
    tier.close()
    assert tier.segments() == []


def own_memfds() -> list[str]:
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "sessioncache-" in target:
            names.append(target)
    return names


def test_segments_have_no_name_in_dev_shm_and_close_frees_their_descriptors():
    gc.collect()
    shm_before = set(os.listdir("/dev/shm")) if Path("/dev/shm").is_dir() else set()
    before = Counter(own_memfds())  # other tiers of this test process, if any
    tier = SharedCpuTier(1 << 20, chunk_bytes=4096, name="shmtest", grow_chunks=False)
    for i in range(4):
        tier.put(PutItem(bid(i), b"\x01" * 2048, NS))
    # each twice: the tier's descriptor and the one its mapping keeps
    assert Counter(own_memfds()) - before == Counter(
        {
            "/memfd:sessioncache-shmtest-1 (deleted)": 2,
            "/memfd:sessioncache-shmtest-2 (deleted)": 2,
        }
    )
    shm_after = set(os.listdir("/dev/shm")) if Path("/dev/shm").is_dir() else set()
    assert not [n for n in shm_after - shm_before if "sessioncache" in n]
    tier.close()
    gc.collect()
    assert Counter(own_memfds()) - before == Counter()


def test_a_tier_dropped_without_close_gives_its_descriptors_back():
    tier = SharedCpuTier(1 << 20, chunk_bytes=4096, name="dropped", grow_chunks=False)
    tier.put(PutItem(bid(1), b"\x01" * 2048, NS))
    assert any("sessioncache-dropped-" in name for name in own_memfds())
    del tier
    gc.collect()
    assert not any("sessioncache-dropped-" in name for name in own_memfds())


def test_a_child_process_inherits_no_segment():
    tier = SharedCpuTier(1 << 20, chunk_bytes=4096, grow_chunks=False)
    tier.put(PutItem(bid(1), b"\x01" * 2048, NS))
    code = (
        "import os; print(sum('sessioncache-' in os.readlink(f'/proc/self/fd/{f}') "
        "for f in os.listdir('/proc/self/fd') if os.path.exists(f'/proc/self/fd/{f}')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"  # MFD_CLOEXEC
    tier.close()


def test_concurrent_reserve_publish_and_puts_keep_every_block_intact():
    tier = SharedCpuTier(64 * 512, chunk_bytes=16 * 512, grow_chunks=False)
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            for i in range(w * 100, w * 100 + 40):
                data = np.random.default_rng(i).integers(0, 256, 512, dtype=np.uint8)
                if i % 2:
                    slot = tier.reserve(512)
                    slot.payload.numpy()[:] = data
                    assert tier.publish_many([(bid(i), slot)])[0]
                else:
                    tier.put(PutItem(bid(i), data, NS))
                got = tier.get(bid(i))
                assert got is not None and np.array_equal(got.numpy(), data)
                tier.delete(bid(i))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and tier.used_bytes == 0 and len(tier._reserved) == 0
    tier.close()
