"""One suite, every tier: the behaviour the store relies on, whatever holds the bytes."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from sessioncache.errors import PayloadSizeError, TierFull
from sessioncache.hashing import BlockHash
from sessioncache.tiers.base import PutItem, Tier
from sessioncache.tiers.cpu import CpuTier, SharedCpuTier
from sessioncache.tiers.gpu import GpuTier

NS = b"\x07" * 16
TierFactory = Callable[[int], Tier]


def _disk(tmp_path: Path) -> TierFactory:
    from sessioncache.tiers.disk import DiskTier

    counter = iter(range(1_000_000))
    return lambda capacity: DiskTier.open(tmp_path / f"disk{next(counter)}", capacity)


def _redis(_: Path) -> TierFactory:
    """The real Redis ($SESSIONCACHE_TEST_REDIS_URL, default 127.0.0.1:6379): a fresh key
    prefix per tier, whose keys the tier deletes at close."""
    import os
    import uuid

    from sessioncache.redis_link import make_client
    from sessioncache.tiers.redis import RedisTier

    url = os.environ.get("SESSIONCACHE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    return lambda capacity: RedisTier(
        lambda: make_client(url), capacity, prefix=f"sctest:{uuid.uuid4().hex}:", owns_keys=True
    )


FACTORIES: dict[str, Callable[[Path], TierFactory]] = {
    "gpu": lambda _: lambda capacity: GpuTier(capacity, device="cpu", chunk_bytes=4096),
    "cpu": lambda _: lambda capacity: CpuTier(capacity, chunk_bytes=4096),
    # the CPU tier in memfd segments (the same-host path): the same contract
    "cpu-shm": lambda _: lambda capacity: SharedCpuTier(capacity, chunk_bytes=4096),
    # chunks made ahead of need (by a background thread) or all at start: the same contract
    "cpu-shm-spares": lambda _: (
        lambda capacity: SharedCpuTier(capacity, chunk_bytes=4096, spare_chunks=2)
    ),
    "cpu-preallocated": lambda _: (
        lambda capacity: CpuTier(capacity, chunk_bytes=4096, preallocate=True)
    ),
    "disk": _disk,
    "redis": _redis,
}


@pytest.fixture(params=sorted(FACTORIES))
def make_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierFactory]:
    made: list[Tier] = []

    def factory(capacity: int) -> Tier:
        tier = FACTORIES[request.param](tmp_path)(capacity)
        made.append(tier)
        return tier

    yield factory
    for tier in made:
        tier.close()


def bid(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def payload(i: int, size: int = 256) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def as_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.cpu().numpy().tobytes())


def test_is_a_tier(make_tier: TierFactory):
    assert isinstance(make_tier(1024), Tier)


def test_put_get_round_trip_for_every_payload_type(make_tier: TierFactory):
    tier = make_tier(1 << 20)
    data = payload(1, 1000)
    inputs = [
        data,
        bytearray(data),
        memoryview(data),
        np.frombuffer(data, dtype=np.uint8),
        torch.frombuffer(bytearray(data), dtype=torch.uint8),
        np.frombuffer(data, dtype=np.float16),  # any dtype: its bytes are the payload
    ]
    for i, item in enumerate(inputs):
        tier.put(PutItem(bid(i), item, NS))
        got = tier.get(bid(i))
        assert got is not None and got.dtype == torch.uint8 and got.dim() == 1
        assert as_bytes(got) == data
    assert tier.used_bytes == 1000 * len(inputs)
    assert sorted(tier.keys()) == sorted(bid(i) for i in range(len(inputs)))


def test_miss_and_contains(make_tier: TierFactory):
    tier = make_tier(4096)
    assert tier.get(bid(9)) is None and not tier.contains(bid(9))
    tier.put(PutItem(bid(9), payload(9), NS))
    assert tier.contains(bid(9))


def test_put_of_held_id_is_a_no_op(make_tier: TierFactory):
    tier = make_tier(4096)
    tier.put(PutItem(bid(1), payload(1), NS))
    tier.put(PutItem(bid(1), payload(2), NS))
    assert tier.used_bytes == 256
    got = tier.get(bid(1))
    assert got is not None and as_bytes(got) == payload(1)


def test_delete_frees_bytes(make_tier: TierFactory):
    tier = make_tier(4096)
    tier.put(PutItem(bid(1), payload(1), NS))
    assert tier.delete(bid(1)) == 256
    assert tier.delete(bid(1)) == 0
    assert tier.used_bytes == 0 and tier.get(bid(1)) is None and tier.keys() == []


def test_full_tier_raises_tier_full_and_keeps_its_contents(make_tier: TierFactory):
    tier = make_tier(1024)
    for i in range(4):
        assert tier.fits(256)
        tier.put(PutItem(bid(i), payload(i), NS))
    assert not tier.fits(256)
    with pytest.raises(TierFull):
        tier.put(PutItem(bid(99), payload(99), NS))
    assert tier.used_bytes == 1024 and not tier.contains(bid(99))
    for i in range(4):
        got = tier.get(bid(i))
        assert got is not None and as_bytes(got) == payload(i)
    tier.delete(bid(0))
    assert tier.fits(256)
    tier.put(PutItem(bid(99), payload(99), NS))
    got = tier.get(bid(99))
    assert got is not None and as_bytes(got) == payload(99)


@pytest.mark.parametrize("size", [0, 4097])
def test_empty_or_oversize_payload_is_rejected(make_tier: TierFactory, size: int):
    tier = make_tier(4096)
    with pytest.raises(PayloadSizeError):
        tier.put(PutItem(bid(1), b"\x00" * size, NS))
    assert tier.used_bytes == 0 and not tier.contains(bid(1))


def test_several_payload_sizes_share_one_tier(make_tier: TierFactory):
    tier = make_tier(8192)
    tier.put(PutItem(bid(1), payload(1, 100), NS))
    tier.put(PutItem(bid(2), payload(2, 3000), NS))
    tier.put(PutItem(bid(3), payload(3, 100), NS))
    assert tier.used_bytes == 3200
    for i, size in [(1, 100), (2, 3000), (3, 100)]:
        got = tier.get(bid(i))
        assert got is not None and as_bytes(got) == payload(i, size)


def test_concurrent_puts_gets_and_deletes_lose_nothing(make_tier: TierFactory):
    tier = make_tier(128 * 512)
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for i in range(w * 100, w * 100 + 60):
                tier.put(PutItem(bid(i), payload(i, 512), NS))
                got = tier.get(bid(i))
                assert got is not None and as_bytes(got) == payload(i, 512)
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
    assert sorted(tier.keys()) == sorted(kept)
    assert tier.used_bytes == 512 * len(kept)
    for h in kept:
        got = tier.get(h)
        assert got is not None and as_bytes(got) == payload(int.from_bytes(h, "little"), 512)


def test_same_id_from_many_threads_is_stored_once(make_tier: TierFactory):
    tier = make_tier(8192)
    barrier = threading.Barrier(6)

    def worker() -> None:
        barrier.wait()
        # a disk tier may count a racing duplicate against capacity for a moment
        with contextlib.suppress(TierFull):
            tier.put(PutItem(bid(5), payload(5), NS))

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tier.keys() == [bid(5)] and tier.used_bytes == 256
