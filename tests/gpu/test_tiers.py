"""The GPU tier on the device, and blocks moving between GPU, CPU and disk tiers: the copies
into a device slot, out of one into a host tier (demotion), and back up (promotion)."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import torch

from sessioncache.clock import ManualClock
from sessioncache.hashing import BlockHash, Namespace, block_hashes
from sessioncache.hostpin import HostRegistration
from sessioncache.store import TieredStore
from sessioncache.tiers.base import PutItem
from sessioncache.tiers.cpu import CpuTier, SharedCpuTier
from sessioncache.tiers.disk import DiskTier
from sessioncache.tiers.gpu import GpuTier
from tests.gpu.conftest import host_bytes, pattern

NS = Namespace("gpu-test-model", 4, "bf16", "test-layout")
ROOT = NS.root()
SIZE = 1 << 20


def chain(seed: int, blocks: int) -> list[BlockHash]:
    rng = np.random.default_rng(seed)
    return block_hashes(NS, rng.integers(0, 50_000, blocks * NS.block_tokens))


def test_the_gpu_tier_holds_blocks_on_its_device(device: torch.device) -> None:
    tier = GpuTier(8 * SIZE, device=device)
    assert tier.device == device
    a, b, c = chain(1, 3)
    from_host = pattern(1, SIZE, torch.device("cpu"))
    from_device = pattern(2, SIZE, device)
    tier.put(PutItem(a, bytes(from_host.numpy()), ROOT))  # host bytes into a device slot
    tier.put(PutItem(b, from_device, ROOT))  # device to device
    tier.put(PutItem(c, from_host.numpy(), ROOT))
    for h, want in ((a, from_host), (b, from_device), (c, from_host)):
        view = tier.get(h)
        assert view is not None and view.device.type == device.type
        assert host_bytes(view) == host_bytes(want)
        # the caller's copy of the view (what an engine does with a hit)
        mine = torch.empty(SIZE, dtype=torch.uint8, device=device)
        mine.copy_(view)
        assert host_bytes(mine) == host_bytes(want)
    tier.close()


def test_blocks_move_down_and_back_up_between_gpu_cpu_and_disk(
    device: torch.device, tmp_path: Path
) -> None:
    clock = ManualClock()
    store = TieredStore(
        [
            GpuTier(2 * SIZE, device=device),
            CpuTier(2 * SIZE),
            DiskTier.open(tmp_path / "blocks", 8 * SIZE),
        ],
        clock=clock,
        promote_on_get=True,
    )
    blocks = [chain(10 + i, 1)[0] for i in range(5)]
    payloads = {h: pattern(i, SIZE, device) for i, h in enumerate(blocks)}
    for h in blocks:
        store.writes.put([h], [payloads[h]], namespace_root=ROOT)
        clock.advance(1)
    # the oldest went down: GPU -> CPU (copied straight off the device) -> disk
    assert [store.reads.where(h)[0] for h in blocks] == ["disk", "cpu", "cpu", "gpu", "gpu"]
    assert store.stats().counters.demotions >= 3
    for h in blocks:
        assert host_bytes(store.reads.get(h, promote=False)) == host_bytes(payloads[h])
    # a disk hit comes back up to the GPU tier, byte-exact
    got = store.reads.get(blocks[0])
    assert store.reads.where(blocks[0])[0] == "gpu"
    assert got.device.type == device.type
    assert host_bytes(got) == host_bytes(payloads[blocks[0]])
    assert store.stats().counters.promotions >= 1
    store.close()


def test_the_shared_cpu_tier_registers_its_segments_where_cuda_is(device: torch.device) -> None:
    gc.collect()  # registrations of earlier tests' dropped memory end now, not during this one
    before = HostRegistration.registered_bytes
    tier = SharedCpuTier(8 * SIZE, chunk_bytes=4 * SIZE, register_cuda=True)
    (h,) = chain(30, 1)
    tier.put(PutItem(h, pattern(3, SIZE, device), ROOT))  # a device payload into shared memory
    view = tier.get(h)
    assert view is not None and host_bytes(view) == host_bytes(pattern(3, SIZE, device))
    registered = HostRegistration.registered_bytes - before
    if torch.cuda.is_available():
        assert registered >= 4 * SIZE  # its segment, at least
    else:
        assert registered == 0
    tier.delete(h)
    tier.close()  # every segment unregistered before it goes
    assert HostRegistration.registered_bytes == before
