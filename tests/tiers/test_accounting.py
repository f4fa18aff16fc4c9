"""AccountingTier: the tier contract, minus byte content (it keeps sizes only)."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import torch

from sessioncache.clock import ManualClock
from sessioncache.errors import PayloadSizeError, TierFull
from sessioncache.hashing import BlockHash
from sessioncache.store import TieredStore
from sessioncache.tiers.accounting import AccountingTier, zero_payload
from sessioncache.tiers.base import PutItem, Tier
from sessioncache.tiers.payload import payload_nbytes

NS = b"\x07" * 16


def bid(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def sized(n: int) -> np.ndarray:
    """A payload of ``n`` bytes that allocates nothing."""
    return np.broadcast_to(np.uint8(0), (n,))


def test_is_a_tier():
    tier = AccountingTier("sim", 1024)
    assert isinstance(tier, Tier)
    assert tier.name == "sim" and tier.capacity_bytes == 1024 and not tier.durable
    assert AccountingTier("d", 1, durable=True).durable


def test_sized_payloads_account_their_length_without_allocating():
    assert payload_nbytes(sized(1 << 30)) == 1 << 30
    view = zero_payload(1 << 30)
    assert payload_nbytes(view) == 1 << 30 and view.untyped_storage().nbytes() == 1


def test_put_get_accounts_sizes_for_every_payload_type():
    tier = AccountingTier("sim", 1 << 20)
    data = bytes(1000)
    inputs = [
        data,
        bytearray(data),
        memoryview(data),
        np.frombuffer(data, dtype=np.uint8),
        torch.zeros(1000, dtype=torch.uint8),
        np.frombuffer(data, dtype=np.float16),
        sized(1000),
    ]
    for i, item in enumerate(inputs):
        tier.put(PutItem(bid(i), item, NS))
        got = tier.get(bid(i))
        assert got is not None and got.dtype == torch.uint8 and got.dim() == 1
        assert got.numel() == 1000
    assert tier.used_bytes == 1000 * len(inputs) and len(tier) == len(inputs)
    assert sorted(tier.keys()) == sorted(bid(i) for i in range(len(inputs)))


def test_miss_contains_and_no_op_put_of_a_held_id():
    tier = AccountingTier("sim", 4096)
    assert tier.get(bid(9)) is None and not tier.contains(bid(9))
    tier.put(PutItem(bid(9), sized(256), NS))
    tier.put(PutItem(bid(9), sized(512), NS))
    assert tier.contains(bid(9)) and tier.used_bytes == 256
    got = tier.get(bid(9))
    assert got is not None and got.numel() == 256


def test_delete_frees_bytes():
    tier = AccountingTier("sim", 4096)
    tier.put(PutItem(bid(1), sized(256), NS))
    assert tier.delete(bid(1)) == 256 and tier.delete(bid(1)) == 0
    assert tier.used_bytes == 0 and tier.get(bid(1)) is None and tier.keys() == []


def test_full_tier_raises_tier_full_and_keeps_its_contents():
    tier = AccountingTier("sim", 1024)
    for i in range(4):
        assert tier.fits(256)
        tier.put(PutItem(bid(i), sized(256), NS))
    assert not tier.fits(256)
    with pytest.raises(TierFull):
        tier.put(PutItem(bid(99), sized(256), NS))
    assert tier.used_bytes == 1024 and not tier.contains(bid(99))
    tier.delete(bid(0))
    tier.put(PutItem(bid(99), sized(256), NS))
    assert tier.contains(bid(99))


@pytest.mark.parametrize("size", [0, 4097])
def test_empty_or_oversize_payload_is_rejected(size: int):
    tier = AccountingTier("sim", 4096)
    with pytest.raises(PayloadSizeError):
        tier.put(PutItem(bid(1), b"\x00" * size, NS))
    assert tier.used_bytes == 0 and not tier.contains(bid(1))


def test_negative_capacity_is_rejected():
    with pytest.raises(ValueError):
        AccountingTier("sim", -1)


def test_several_sizes_and_close():
    tier = AccountingTier("sim", 8192)
    tier.put(PutItem(bid(1), sized(100), NS))
    tier.put(PutItem(bid(2), sized(3000), NS))
    assert tier.used_bytes == 3100
    tier.close()
    assert tier.used_bytes == 0 and tier.keys() == []


def test_concurrent_puts_and_deletes_lose_nothing():
    tier = AccountingTier("sim", 128 * 512)
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for i in range(w * 100, w * 100 + 60):
                tier.put(PutItem(bid(i), sized(512), NS))
                got = tier.get(bid(i))
                assert got is not None and got.numel() == 512
                if i % 3:
                    assert tier.delete(bid(i)) == 512
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    kept = [bid(i) for w in range(4) for i in range(w * 100, w * 100 + 60) if i % 3 == 0]
    assert sorted(tier.keys()) == sorted(kept) and tier.used_bytes == 512 * len(kept)


def test_same_id_from_many_threads_is_stored_once():
    tier = AccountingTier("sim", 8192)
    barrier = threading.Barrier(6)

    def worker() -> None:
        barrier.wait()
        with contextlib.suppress(TierFull):
            tier.put(PutItem(bid(5), sized(256), NS))

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tier.keys() == [bid(5)] and tier.used_bytes == 256


def test_a_store_over_accounting_tiers_demotes_and_promotes_by_size():
    cpu, disk = AccountingTier("cpu", 2 * 256), AccountingTier("disk", 8 * 256)
    store = TieredStore([cpu, disk], clock=ManualClock())
    ids = [bid(i) for i in range(1, 5)]
    store.writes.put(ids, [sized(256)] * 4, namespace_root=NS)
    assert cpu.used_bytes + disk.used_bytes >= 4 * 256
    assert store.reads.lookup(ids).num_blocks == 4
    lower = [h for h in ids if store.reads.where(h) == ["disk"]]
    assert lower
    data = store.reads.get(lower[0])  # promoted into cpu with the same accounted size
    assert data.numel() == 256 and "cpu" in store.reads.where(lower[0])
    assert cpu.used_bytes <= cpu.capacity_bytes and disk.used_bytes <= disk.capacity_bytes
