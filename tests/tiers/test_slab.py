"""Slab specifics: chunked growth within capacity, slot reuse, reclaiming idle chunks."""

from __future__ import annotations

import pytest
import torch

from sessioncache.hashing import BlockHash
from sessioncache.tiers.base import PutItem
from sessioncache.tiers.cpu import CpuTier
from sessioncache.tiers.gpu import GpuTier, default_device

NS = b"\x01" * 16


def bid(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def test_allocation_never_exceeds_capacity_and_slots_are_reused():
    tier = CpuTier(1000, chunk_bytes=400)
    for i in range(10):
        tier.put(PutItem(bid(i), bytes([i]) * 100, NS))
    assert tier.allocated_bytes == 1000 and not tier.fits(100)
    tier.delete(bid(3))
    tier.put(PutItem(bid(42), b"\x2a" * 100, NS))
    assert tier.allocated_bytes == 1000
    got = tier.get(bid(42))
    assert got is not None and bytes(got.numpy()) == b"\x2a" * 100


def test_idle_chunks_of_another_size_are_reclaimed():
    tier = CpuTier(1000, chunk_bytes=1000)
    for i in range(10):
        tier.put(PutItem(bid(i), b"\x00" * 100, NS))
    assert not tier.fits(500)
    for i in range(10):
        tier.delete(bid(i))
    assert tier.fits(500)
    tier.put(PutItem(bid(100), b"\x05" * 500, NS))
    tier.put(PutItem(bid(101), b"\x06" * 500, NS))
    assert tier.used_bytes == 1000 and tier.allocated_bytes == 1000


def test_get_is_a_zero_copy_view_of_the_slot():
    tier = CpuTier(1000)
    tier.put(PutItem(bid(1), b"\x01" * 100, NS))
    a, b = tier.get(bid(1)), tier.get(bid(1))
    assert a is not None and b is not None
    assert a.data_ptr() == b.data_ptr()


def test_gpu_tier_runs_on_the_given_device():
    tier = GpuTier(1000, device="cpu")
    tier.put(PutItem(bid(1), torch.ones(25, dtype=torch.float32), NS))
    got = tier.get(bid(1))
    assert got is not None and got.device.type == "cpu"
    assert torch.equal(got.view(torch.float32), torch.ones(25))


def test_default_device_is_the_current_cuda_device_else_the_cpu():
    if torch.cuda.is_available():
        expected = torch.device("cuda", torch.cuda.current_device())
    else:
        expected = torch.device("cpu")
    assert default_device() == expected
    assert GpuTier(1000).device == expected  # a GpuTier given no device lands there


def test_default_device_names_the_current_cuda_device_not_cuda_0(
    monkeypatch: pytest.MonkeyPatch,
):
    # CI has no GPU: make torch report one whose current device is cuda:1, to check the
    # branch a CPU-only machine never takes (nothing is allocated on it).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert default_device() == torch.device("cuda", 1)
