"""Write-behind: a store answered once memory holds it, its disk copy following in batches with
one round of syncs; durable writes waiting for theirs; bounds, back-pressure per tenant, the
degraded signal, and failures that never answer ``durable`` for a block in memory only."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from sessioncache.clock import ManualClock
from sessioncache.errors import DurableStoreFailed, TierFull
from sessioncache.hashing import BlockHash, Namespace, block_hashes
from sessioncache.store import TieredStore, behind
from sessioncache.tiers.base import PutItem
from sessioncache.tiers.cpu import CpuTier
from sessioncache.tiers.disk import DiskTier

NS = Namespace("behind", 4, "u8", "x")
ROOT = NS.root()
OTHER = Namespace("behind", 4, "u8", "other").root()
SIZE = 4096


def chain(seed: int, blocks: int, ns: Namespace = NS) -> list[BlockHash]:
    return block_hashes(ns, [seed * 10_000 + i for i in range(blocks * ns.block_tokens)])


def data(h: bytes) -> bytes:
    return (bytes(h) * (SIZE // 16))[:SIZE]


class CountingDisk(DiskTier):
    """A disk tier that counts its group commits and can be slowed or made to fail."""

    def __init__(self, root: Path, capacity: int) -> None:
        super().__init__(root, capacity, fsync=True)
        self.groups: list[int] = []
        self.written: list[list[bytes]] = []  # each group's ids
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False

    def put_group(self, items: Sequence[PutItem]) -> list[Exception | None]:
        self.gate.wait()
        self.groups.append(len(items))
        self.written.append([item.block_hash for item in items])
        if self.fail:
            return [TierFull("disk: full (test)") for _ in items]
        return super().put_group(items)


def make(tmp_path: Path, *, bound: int = 1 << 20, share: float = 0.5, cpu_blocks: int = 64):
    disk = CountingDisk(tmp_path / "disk", 1 << 30)
    store = TieredStore(
        [CpuTier(cpu_blocks * SIZE, chunk_bytes=16 * SIZE), disk],
        clock=ManualClock(),
        write_behind_bytes=bound,
        write_behind_tenant_share=share,
    )
    assert store.write_behind is not None
    store.write_behind.owner = lambda root: "bob" if root == OTHER else "alice"
    return store, disk


def on_disk(store: TieredStore, hashes: list[BlockHash]) -> list[bool]:
    out = []
    for h in hashes:
        meta = store.reads.meta(h)
        out.append(meta is not None and 1 in meta.tiers)
    return out


def test_a_store_is_answered_from_memory_and_reaches_disk_in_groups(tmp_path: Path) -> None:
    store, disk = make(tmp_path)
    hashes = chain(1, 32)
    disk.gate.clear()  # the disk is busy: the answer does not wait for it
    result = store.writes.put(hashes, [data(h) for h in hashes], namespace_root=ROOT)
    assert result.stored == hashes
    assert on_disk(store, hashes) == [False] * 32
    assert store.write_behind.backlog_bytes == 32 * SIZE  # type: ignore[union-attr]
    disk.gate.set()
    assert store.write_behind.flush(10)  # type: ignore[union-attr]
    assert on_disk(store, hashes) == [True] * 32
    assert sum(disk.groups) == 32 and max(disk.groups) > 1  # many blocks per round of syncs
    assert bytes(disk.get(hashes[5]).numpy()) == data(hashes[5])  # type: ignore[union-attr]
    store.close()


def test_a_durable_store_waits_for_its_blocks_on_disk_and_shares_syncs(tmp_path: Path) -> None:
    store, disk = make(tmp_path)
    hashes = chain(2, 16)
    result = store.writes.put(hashes, [data(h) for h in hashes], namespace_root=ROOT, durable=True)
    assert result.stored == hashes
    assert on_disk(store, hashes) == [True] * 16  # before the answer
    assert len(disk.groups) < 16
    store.close()


def test_evicting_a_block_already_on_disk_is_a_drop(tmp_path: Path) -> None:
    store, disk = make(tmp_path, cpu_blocks=16)
    first = chain(3, 16)
    store.writes.put(first, [data(h) for h in first], namespace_root=ROOT)
    assert store.write_behind.flush(10)  # type: ignore[union-attr]
    written = sum(disk.groups)
    second = chain(4, 16)
    store.writes.put(second, [data(h) for h in second], namespace_root=ROOT)
    assert store.write_behind.flush(10)  # type: ignore[union-attr]
    # the first chain left memory for the second: dropped there, never written again
    assert on_disk(store, first) == [True] * 16
    assert sum(disk.groups) == written + 16
    assert store.counters().demotions == 0
    store.close()


def test_a_full_queue_stalls_the_tenant_flooding_it_not_the_other(tmp_path: Path) -> None:
    store, disk = make(tmp_path, bound=8 * SIZE, share=0.5)
    disk.gate.clear()  # the disk stalls
    alice = chain(5, 12)
    done = threading.Event()

    def flood() -> None:
        store.writes.put(alice, [data(h) for h in alice], namespace_root=ROOT)
        done.set()

    threading.Thread(target=flood, daemon=True).start()
    time.sleep(0.3)
    assert not done.is_set()  # alice waits: her share (4 blocks) is queued
    wb = store.write_behind
    assert wb is not None and wb.tenants.get("alice") <= 4 * SIZE
    bob = chain(6, 3, Namespace("behind", 4, "u8", "other"))
    started = time.monotonic()
    store.writes.put(bob, [data(h) for h in bob], namespace_root=OTHER)  # within his share
    assert time.monotonic() - started < 0.2
    disk.gate.set()
    assert done.wait(10)
    assert wb.flush(10) and on_disk(store, alice) == [True] * 12
    store.close()


def test_a_durable_store_waits_for_the_batch_being_written_not_another_tenants_backlog(
    tmp_path: Path,
) -> None:
    store, disk = make(tmp_path, bound=4 << 20, cpu_blocks=256)
    wb = store.write_behind
    assert wb is not None
    disk.gate.clear()
    bob = chain(10, 192, Namespace("behind", 4, "u8", "other"))  # three batches
    store.writes.put(bob, [data(h) for h in bob], namespace_root=OTHER)
    assert wait_for(lambda: len(disk.groups) == 0 and wb.backlog_bytes == 192 * SIZE)
    time.sleep(0.2)  # the thread took bob's first batch: it waits on the disk
    alice = chain(11, 2)
    put = threading.Thread(
        target=store.writes.put,
        args=(alice, [data(h) for h in alice]),
        kwargs={"namespace_root": ROOT, "durable": True},
    )
    put.start()
    assert wait_for(lambda: wb.tenants.get("alice") == 2 * SIZE)
    disk.gate.set()
    put.join(10)
    assert wb.flush(10)
    # next: alice's blocks, one of bob's between them, topped up to an eighth of a batch (8
    # blocks), not behind bob's other 127 blocks
    assert disk.written[:2] == [bob[:64], [alice[0], bob[64], alice[1], *bob[65:70]]]
    assert [h for group in disk.written[2:] for h in group] == bob[70:]
    store.close()


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_backlog_above_80_percent_for_long_enough_is_degraded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(behind, "DEGRADED_AFTER_S", 0.2)
    store, disk = make(tmp_path, bound=10 * SIZE, share=1.0)
    wb = store.write_behind
    assert wb is not None
    disk.gate.clear()
    hashes = chain(7, 9)
    threading.Thread(
        target=store.writes.put,
        args=(hashes, [data(h) for h in hashes]),
        kwargs={"namespace_root": ROOT},
        daemon=True,
    ).start()
    time.sleep(0.1)
    assert not wb.degraded()
    time.sleep(0.3)
    assert wb.degraded()
    disk.gate.set()
    assert wb.flush(10) and not wb.degraded()
    store.close()


def test_a_disk_that_fails_never_answers_durable(tmp_path: Path) -> None:
    store, disk = make(tmp_path)
    disk.fail = True
    hashes = chain(8, 4)
    with pytest.raises(DurableStoreFailed):
        store.writes.put(hashes, [data(h) for h in hashes], namespace_root=ROOT, durable=True)
    assert on_disk(store, hashes) == [False] * 4
    quiet = chain(9, 4)
    store.writes.put(quiet, [data(h) for h in quiet], namespace_root=ROOT)  # not durable: fine
    assert store.write_behind.flush(10)  # type: ignore[union-attr]
    assert store.write_behind.failed >= 8  # type: ignore[union-attr]
    assert store.reads.lookup(quiet).num_blocks == 4  # held in memory
    disk.fail = False
    store.writes.put(hashes, [data(h) for h in hashes], namespace_root=ROOT, durable=True)
    assert on_disk(store, hashes) == [True] * 4  # the retry makes them durable
    store.close()
