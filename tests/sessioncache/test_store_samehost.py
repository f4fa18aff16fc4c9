"""The store's same-host primitives over a shared-memory CPU tier: locate under a lease (with
promotion from lower tiers), stage/commit/abort, and the lease rule readers rely on."""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from sessioncache.clock import ManualClock
from sessioncache.errors import DurableStoreFailed, InvalidInput, LeaseNotFound, PayloadSizeError
from sessioncache.hashing import BlockHash, Namespace, block_hashes
from sessioncache.status import BlockStatus
from sessioncache.store import TieredStore
from sessioncache.tiers.base import SlotLocation
from sessioncache.tiers.cpu import CpuTier, SharedCpuTier
from sessioncache.tiers.disk import DiskTier

STAGED, PRESENT, DROPPED = BlockStatus.STORED, BlockStatus.PRESENT, BlockStatus.DROPPED
NS = Namespace("test-model", 4, "float16", "test-layout")
ROOT = NS.root()
SIZE = 4096


def chain(seed: int, blocks: int) -> list[BlockHash]:
    rng = np.random.default_rng(seed)
    return block_hashes(NS, rng.integers(0, 50_000, blocks * NS.block_tokens))


def data(h: bytes, size: int = SIZE) -> bytes:
    return np.random.default_rng(list(h)).integers(0, 256, size, dtype=np.uint8).tobytes()


class Peer:
    """What a same-host client sees: the segments mapped (read-only: nothing else may map
    them writable) from descriptors the tier hands out. Its writes stand for the node's copy of
    what the client staged (a same-host connection's ``copy_in``), into the node's mapping."""

    def __init__(self, store: TieredStore) -> None:
        tier = store.shared_memory_tier
        assert isinstance(tier, SharedCpuTier)
        self.tier = tier
        self.maps: dict[int, mmap.mmap] = {}

    def view(self, where: SlotLocation) -> memoryview:
        if where.segment not in self.maps:
            fd = self.tier.segment_fd(where.segment)
            try:
                size = os.fstat(fd).st_size
                self.maps[where.segment] = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        return memoryview(self.maps[where.segment])[where.offset : where.offset + where.nbytes]

    def read(self, where: SlotLocation) -> bytes:
        return bytes(self.view(where))

    def write(self, where: SlotLocation, payload: bytes) -> None:
        node = next(
            c.tensor
            for slab in self.tier._slabs.values()
            for c in slab.chunks
            if c is not None and c.segment == where.segment
        )
        flat = node.view(-1)
        flat[where.offset : where.offset + where.nbytes] = torch.frombuffer(
            bytearray(payload), dtype=torch.uint8
        )


def test_no_peer_can_map_a_segment_writable(clock: ManualClock):
    store = shm_store(clock)
    hashes = chain(1, 1)
    store.writes.put(hashes, [data(hashes[0])], namespace_root=ROOT)
    tier = store.shared_memory_tier
    assert isinstance(tier, SharedCpuTier)
    [segment] = tier.segments()
    fd = tier.segment_fd(segment)
    try:
        size = os.fstat(fd).st_size
        with pytest.raises(PermissionError):
            mmap.mmap(fd, size)  # shared and writable
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(reopened, size)
        finally:
            os.close(reopened)
    finally:
        os.close(fd)
    assert store.reads.get_bytes(hashes[0]) == data(hashes[0])


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def shm_store(
    clock: ManualClock, blocks: int = 16, disk: Path | None = None, **kw: object
) -> TieredStore:
    tiers: list[SharedCpuTier | DiskTier] = [SharedCpuTier(blocks * SIZE, chunk_bytes=4 * SIZE)]
    if disk is not None:
        tiers.append(DiskTier.open(disk, 64 * SIZE, fsync=False))
    return TieredStore(tiers, clock=clock, **kw)  # type: ignore[arg-type]


def put(store: TieredStore, hashes: list[BlockHash], **kw: object) -> None:
    store.writes.put(hashes, [data(h) for h in hashes], namespace_root=ROOT, **kw)  # type: ignore[arg-type]


def test_a_leased_match_is_located_byte_exact_with_checksums(clock: ManualClock):
    store = shm_store(clock)
    hashes = chain(1, 5)
    put(store, hashes)
    match = store.reads.lookup(hashes, lease_s=30)
    located = store.reads.locate(match.hashes)
    assert [s.block_hash for s in located] == hashes
    peer = Peer(store)
    for slot in located:
        assert peer.read(slot.location) == data(slot.block_hash)
        assert slot.checksum == xxhash.xxh3_64_intdigest(data(slot.block_hash))
    assert store.reads.meta(hashes[0]).checksum == located[0].checksum  # type: ignore[union-attr]
    assert match.lease is not None
    store.reads.release(match.lease.id)


def test_locate_needs_a_pin_and_a_shared_memory_tier(clock: ManualClock):
    store = shm_store(clock)
    hashes = chain(1, 3)
    put(store, hashes)
    assert store.reads.locate(hashes) == []  # not leased: nothing guards the slots
    plain = TieredStore([CpuTier(4 * SIZE)], clock=clock)
    assert plain.shared_memory_tier is None
    with pytest.raises(InvalidInput):
        plain.reads.locate(hashes)
    with pytest.raises(InvalidInput):
        plain.writes.stage(hashes, namespace_root=ROOT, nbytes=SIZE)


def test_blocks_held_only_on_disk_are_copied_into_shared_memory_first(
    clock: ManualClock, tmp_path: Path
):
    store = shm_store(clock, blocks=4, disk=tmp_path / "disk", promote_on_get=False)
    old = chain(1, 4)
    put(store, old, durable=True)
    clock.advance(10)
    put(store, chain(2, 4), durable=True)  # pushes the old chain out of the CPU tier
    assert all(store.reads.where(h) == ["disk"] for h in old)
    match = store.reads.lookup(old, lease_s=30)
    located = store.reads.locate(match.hashes)
    assert [s.block_hash for s in located] == old
    peer = Peer(store)
    assert all(peer.read(s.location) == data(s.block_hash) for s in located)
    assert all(store.reads.where(h) == ["cpu", "disk"] for h in old)
    assert store.counters().promotions == 4


def test_the_answer_stops_where_shared_memory_has_no_room(clock: ManualClock, tmp_path: Path):
    store = shm_store(clock, blocks=2, disk=tmp_path / "disk")
    pinned = chain(1, 2)
    put(store, pinned)
    held = store.reads.lookup(pinned, lease_s=30)  # both CPU slots pinned
    cold = chain(2, 3)
    put(store, cold, tier="disk")
    match = store.reads.lookup(cold, lease_s=30)
    assert match.num_blocks == 3 and store.reads.locate(match.hashes) == []
    assert held.lease is not None and match.lease is not None
    store.reads.release(held.lease.id)
    assert [s.block_hash for s in store.reads.locate(match.hashes)] == cold[:2]  # room for two


def test_a_located_slot_stays_while_leased_though_a_faster_tier_holds_the_block(
    clock: ManualClock,
):
    """A lease holds the block, not each copy, but in shared memory it holds the slots it
    hands out: a peer may be reading them, whatever a faster tier holds."""
    from sessioncache.tiers.gpu import GpuTier

    store = TieredStore(
        [GpuTier(4 * SIZE, device="cpu"), SharedCpuTier(4 * SIZE, chunk_bytes=4 * SIZE)],
        clock=clock,
    )
    mine = chain(1, 2)
    put(store, mine)
    clock.advance(1)
    put(store, chain(2, 4))  # pushes mine down into shared memory
    assert all(store.reads.where(h) == ["cpu"] for h in mine)
    match = store.reads.lookup(mine, lease_s=30)
    located = store.reads.locate(match.hashes)
    for h in mine:
        store.reads.get(h)  # promoted: the faster tier holds them too
    assert all(store.reads.where(h) == ["gpu", "cpu"] for h in mine)
    clock.advance(1)
    put(store, chain(3, 4))  # room needed in shared memory
    peer = Peer(store)
    assert all(store.reads.where(h)[-1] == "cpu" for h in mine)
    assert all(peer.read(s.location) == data(s.block_hash) for s in located)
    assert match.lease is not None
    store.reads.release(match.lease.id)


def test_concurrent_locates_copy_a_block_in_once(clock: ManualClock, tmp_path: Path):
    store = shm_store(clock, blocks=8, disk=tmp_path / "disk")
    hashes = chain(1, 6)
    put(store, hashes, tier="disk")
    match = store.reads.lookup(hashes, lease_s=30)
    results: list[list[BlockHash]] = []
    barrier = threading.Barrier(4)

    def reader() -> None:
        barrier.wait()
        results.append([s.block_hash for s in store.reads.locate(match.hashes)])

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [hashes] * 4
    assert store.counters().promotions == 6


def test_a_release_after_the_lease_ran_out_says_so_even_before_it_is_reaped(clock: ManualClock):
    store = shm_store(clock)
    hashes = chain(1, 2)
    put(store, hashes)
    lease = store.reads.lookup(hashes, lease_s=5).lease
    assert lease is not None
    clock.advance(6)  # nothing reaped it yet (no lookup since)
    with pytest.raises(LeaseNotFound):
        store.reads.release(lease.id)
    assert store.stats().pinned_blocks == 0  # released all the same
    live = store.reads.lookup(hashes, lease_s=5).lease
    assert live is not None
    clock.advance(4)
    store.reads.release(live.id)  # in time: no error


def test_staged_blocks_are_invisible_until_committed(clock: ManualClock):
    store = shm_store(clock)
    hashes = chain(1, 3)
    staging = store.writes.stage(hashes, namespace_root=ROOT, nbytes=SIZE)
    assert staging.status == [STAGED] * 3
    peer = Peer(store)
    for h, where in zip(hashes, staging.locations, strict=True):
        assert where is not None
        peer.write(where, data(h))
    assert store.reads.lookup(hashes).num_blocks == 0 and not store.reads.contains(hashes[0])
    # a put of a staged id does not race it: it is present (being stored)
    assert (
        store.writes.put([hashes[0]], [data(hashes[0])], namespace_root=ROOT).present == hashes[:1]
    )
    sums = [xxhash.xxh3_64_intdigest(data(h)) for h in hashes]
    result = store.writes.commit(staging, sums, [SIZE] * 3)
    assert result.stored == hashes and not (result.present or result.dropped or result.rejected)
    match = store.reads.lookup(hashes, lease_s=10)
    assert match.hashes == hashes
    located = store.reads.locate(hashes)
    assert [s.location for s in located] == staging.locations  # published in place
    assert [s.checksum for s in located] == sums
    assert store.reads.get_bytes(hashes[2]) == data(hashes[2])
    assert store.reads.meta(hashes[1]).parent == hashes[0]  # type: ignore[union-attr]


def test_a_slot_that_does_not_match_its_checksum_is_rejected_and_the_rest_dropped(
    clock: ManualClock,
):
    store = shm_store(clock)
    tier = store.tiers[0]
    hashes = chain(1, 4)
    staging = store.writes.stage(hashes, namespace_root=ROOT, nbytes=SIZE)
    peer = Peer(store)
    for h, where in zip(hashes, staging.locations, strict=True):
        assert where is not None
        peer.write(where, data(h))
    sums = [xxhash.xxh3_64_intdigest(data(h)) for h in hashes]
    sums[1] ^= 1  # a torn or wrong write
    result = store.writes.commit(staging, sums)
    assert result.stored == hashes[:1] and result.rejected == hashes[1:2]
    assert result.dropped == hashes[2:]
    assert store.reads.lookup(hashes).hashes == hashes[:1]
    assert tier.used_bytes == SIZE and store.stats().blocks == 1
    with pytest.raises(InvalidInput):
        store.writes.commit(staging, sums)  # once only
    wrong_length = store.writes.stage(
        hashes[1:2], namespace_root=ROOT, nbytes=SIZE, parent=hashes[0]
    )
    where = wrong_length.locations[0]
    assert where is not None
    peer.write(where, data(hashes[1]))
    result = store.writes.commit(
        wrong_length, [xxhash.xxh3_64_intdigest(data(hashes[1]))], [SIZE - 1]
    )
    assert result.rejected == hashes[1:2] and tier.used_bytes == SIZE


def test_abort_frees_every_slot_and_publishes_nothing(clock: ManualClock):
    store = shm_store(clock)
    tier = store.tiers[0]
    put(store, chain(1, 1))
    hashes = chain(1, 4)  # the first is held already
    staging = store.writes.stage(hashes, namespace_root=ROOT, nbytes=SIZE)
    assert staging.status == [PRESENT, STAGED, STAGED, STAGED]
    assert tier.used_bytes == 4 * SIZE
    assert store.writes.abort(staging) == 3
    assert store.writes.abort(staging) == 0
    assert tier.used_bytes == SIZE and store.stats().blocks == 1
    assert store.reads.lookup(hashes).num_blocks == 1 and store.reads.meta(hashes[1]) is None
    with pytest.raises(InvalidInput):
        store.writes.commit(staging, [0] * 4)
    again = store.writes.stage(hashes[1:], namespace_root=ROOT, nbytes=SIZE, parent=hashes[0])
    assert again.status == [STAGED] * 3  # nothing left claimed


def test_staging_makes_room_by_demotion_and_drops_past_a_full_tier(
    clock: ManualClock, tmp_path: Path
):
    store = shm_store(clock, blocks=4, disk=tmp_path / "disk")
    old = chain(1, 4)
    put(store, old)
    clock.advance(10)
    hashes = chain(2, 3)
    staging = store.writes.stage(hashes, namespace_root=ROOT, nbytes=SIZE)
    assert staging.status == [STAGED] * 3
    assert [store.reads.where(h) for h in old] == [["cpu"], ["disk"], ["disk"], ["disk"]]
    pinned = store.reads.lookup(old[:1], lease_s=30)
    full = store.writes.stage(chain(3, 2), namespace_root=ROOT, nbytes=SIZE)
    assert full.status == [DROPPED, DROPPED]  # everything left in the tier is pinned or staged
    store.writes.abort(full)
    store.writes.abort(staging)
    assert pinned.lease is not None
    store.reads.release(pinned.lease.id)


def test_a_durable_commit_is_on_disk_when_it_returns(clock: ManualClock, tmp_path: Path):
    store = shm_store(clock, disk=tmp_path / "disk")
    hashes = chain(1, 2)
    staging = store.writes.stage(hashes, namespace_root=ROOT, nbytes=SIZE, durable=True)
    peer = Peer(store)
    for h, where in zip(hashes, staging.locations, strict=True):
        assert where is not None
        peer.write(where, data(h))
    result = store.writes.commit(staging, [xxhash.xxh3_64_intdigest(data(h)) for h in hashes])
    assert result.stored == hashes
    assert all(store.reads.where(h) == ["cpu", "disk"] for h in hashes)
    disk = store.tiers[1]
    assert all(bytes(disk.get(h).numpy()) == data(h) for h in hashes)  # type: ignore[union-attr]
    with pytest.raises(InvalidInput):
        shm_store(clock).writes.stage(hashes, namespace_root=ROOT, nbytes=SIZE, durable=True)


def test_a_durable_commit_the_disk_cannot_take_fails_as_a_durable_put_does(
    clock: ManualClock, tmp_path: Path
):
    """One write path: a staged write whose durable copy cannot be made raises
    ``DurableStoreFailed`` (the block stays in memory only) and frees the rest of the
    staging, as ``put`` does; it is never answered stored and durable."""
    tiers = [SharedCpuTier(16 * SIZE, chunk_bytes=4 * SIZE)]
    tiers.append(DiskTier.open(tmp_path / "disk", SIZE // 2, fsync=False))  # type: ignore[arg-type]
    store = TieredStore(tiers, clock=clock)  # type: ignore[arg-type]
    hashes = chain(3, 3)
    with pytest.raises(DurableStoreFailed):
        put(store, hashes[:1], durable=True)
    staging = store.writes.stage(hashes, namespace_root=ROOT, nbytes=SIZE, durable=True)
    assert staging.status == [PRESENT, STAGED, STAGED]
    peer = Peer(store)
    for h, where in zip(hashes[1:], staging.locations[1:], strict=True):
        assert where is not None
        peer.write(where, data(h))
    with pytest.raises(DurableStoreFailed):
        store.writes.commit(staging, [0] + [xxhash.xxh3_64_intdigest(data(h)) for h in hashes[1:]])
    assert not staging.open and store.reads.where(hashes[1]) == ["cpu"]  # in memory only
    assert not store.reads.contains(hashes[2])  # the rest of the staging was freed
    assert store.stats().pinned_blocks == 0


def test_staging_checks_ids_and_the_namespace_payload_size(clock: ManualClock):
    store = shm_store(clock)
    put(store, chain(1, 1))
    with pytest.raises(PayloadSizeError):
        store.writes.stage(chain(2, 1), namespace_root=ROOT, nbytes=SIZE // 2)
    with pytest.raises(InvalidInput):
        store.writes.stage([b"short"], namespace_root=ROOT, nbytes=SIZE)  # type: ignore[list-item]
    assert store.tiers[0].used_bytes == SIZE


def test_a_staging_commits_in_order_over_several_calls(clock: ManualClock):
    store = shm_store(clock)
    tier = store.tiers[0]
    hashes = chain(1, 6)
    staging = store.writes.stage(hashes, namespace_root=ROOT, nbytes=SIZE)
    peer = Peer(store)
    for h, where in zip(hashes, staging.locations, strict=True):
        assert where is not None
        peer.write(where, data(h))
    sums = [xxhash.xxh3_64_intdigest(data(h)) for h in hashes]
    assert store.writes.commit(staging, sums[:2]).stored == hashes[:2]
    assert store.reads.lookup(hashes).hashes == hashes[:2]  # the rest not yet
    bad = sums[2:4]
    bad[1] ^= 1
    result = store.writes.commit(staging, bad)
    assert result.stored == hashes[2:3] and result.rejected == hashes[3:4]
    with pytest.raises(InvalidInput):
        store.writes.commit(staging, [*sums[4:], 0])  # more than is left
    result = store.writes.commit(staging, sums[4:])
    assert result.dropped == hashes[4:] and not result.stored  # after a rejected block
    assert not staging.open and store.writes.abort(staging) == 0
    assert tier.used_bytes == 3 * SIZE and store.reads.lookup(hashes).hashes == hashes[:3]


def test_abort_after_a_partial_commit_frees_only_the_rest(clock: ManualClock):
    store = shm_store(clock)
    tier = store.tiers[0]
    hashes = chain(1, 4)
    staging = store.writes.stage(hashes, namespace_root=ROOT, nbytes=SIZE)
    peer = Peer(store)
    for h, where in zip(hashes, staging.locations, strict=True):
        assert where is not None
        peer.write(where, data(h))
    store.writes.commit(staging, [xxhash.xxh3_64_intdigest(data(h)) for h in hashes[:1]])
    assert store.writes.abort(staging) == 3
    assert tier.used_bytes == SIZE and store.stats().blocks == 1
    assert store.reads.lookup(hashes).hashes == hashes[:1]
    with pytest.raises(InvalidInput):
        store.writes.commit(staging, [0])
