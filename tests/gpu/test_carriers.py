"""Device tensors over the carriers: same-host loads into and stores from device tensors, the
stream's loads into them, and the rule that makes a same-host load safe on a GPU: the lease
is released only once the device copy is complete (the slot is reused at once after)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from sessioncache.config import Settings
from sessioncache.connector import StreamClient, discover
from sessioncache.connector.samehost import SameHostClient, registered_segments
from sessioncache.dataplane.samehost_server import open_samehost_server
from sessioncache.errors import InvalidInput, PayloadSizeError
from sessioncache.factory import open_node
from sessioncache.hashing import BlockHash, Namespace
from sessioncache.node import CacheNode
from sessioncache.status import BlockStatus
from sessioncache.tiers.base import PutItem
from sessioncache.tiers.cpu import SharedCpuTier
from tests.gpu.conftest import host_bytes, pattern
from tests.support.servers import Server


def ns(device: torch.device) -> Namespace:
    """A namespace per device: the node is the module's, and each device's run stores its
    own blocks (none of them present already)."""
    return Namespace(f"gpu-carriers-{device.type}", block_tokens=16, kv_dtype="bf16", kv_layout="x")


BLOCK = 1 << 20


def tokens(seed: int, blocks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, blocks * 16).astype(np.uint32)


def same_host(node: Server, key: str) -> SameHostClient:
    return SameHostClient.discover(node.url, api_key=key, timeout=30)


def test_same_host_stores_from_and_loads_into_device_tensors(
    node: Server, device: torch.device
) -> None:
    payloads = [pattern(100 + i, BLOCK, device) for i in range(6)]
    with same_host(node, "key-acme") as acme, same_host(node, "key-globex") as globex:
        root = acme.resolve(ns(device))
        ids = acme.block_hashes(root, tokens(1, 6))
        ack = acme.store(root, tokens(1, 6), payloads)  # copied off the device, then hashed
        assert ack.kept == 6 and ack.status == [BlockStatus.STORED] * 6, ack  # none present
        found = acme.locate(root, ids, lease_ms=10_000)
        assert found.located == 6
        out = [torch.zeros(BLOCK, dtype=torch.uint8, device=device) for _ in range(6)]
        assert acme.load_into(found, out, verify=True) == [True] * 6
        assert [host_bytes(o) for o in out] == [host_bytes(p) for p in payloads]
        # bf16 rows, the engine's own dtype: the same bytes
        rows = [torch.zeros(BLOCK // 2, dtype=torch.bfloat16, device=device) for _ in range(2)]
        acme.load_into(acme.locate(root, ids[:2], lease_ms=10_000), rows)
        assert [host_bytes(r) for r in rows] == [host_bytes(p) for p in payloads[:2]]
        if device.type == "cuda":
            assert registered_segments(acme), "the client registers the segments it copies from"
        # The other tenant's namespace has other ids: it reaches none of acme's blocks.
        groot = globex.resolve(ns(device))
        assert groot != root
        assert globex.locate(groot, globex.block_hashes(groot, tokens(1, 6))).located == 0
        # A wrong-sized or gappy device buffer is refused before a byte moves.
        found = acme.locate(root, ids[:1], lease_ms=10_000)
        with pytest.raises(PayloadSizeError):
            acme.load_into(found, [torch.zeros(BLOCK - 1, dtype=torch.uint8, device=device)])
        gappy = torch.zeros((2, BLOCK), dtype=torch.uint8, device=device)[:, ::2]
        with pytest.raises(InvalidInput):
            acme.store(root, tokens(2, 1), [gappy])


def test_stream_loads_into_device_tensors(node: Server, device: torch.device) -> None:
    client = StreamClient.connect(discover(node.url, api_key="key-acme"), api_key="key-acme")
    with client:
        root = client.resolve(ns(device))
        payloads = [pattern(200 + i, BLOCK, device) for i in range(5)]
        client.store(root, tokens(3, 5), payloads)
        ids = client.block_hashes(root, tokens(3, 5))
        found = client.lookup(root, ids, lease_ms=10_000)
        assert found.matched == 5
        out = [torch.zeros(BLOCK, dtype=torch.uint8, device=device) for _ in range(5)]
        assert client.load_into(found, out, release=True) == [True] * 5
        assert [host_bytes(o) for o in out] == [host_bytes(p) for p in payloads]
        # mixed host and device buffers in one load
        mixed = [np.zeros(BLOCK, np.uint8), torch.zeros(BLOCK, dtype=torch.uint8, device=device)]
        assert client.load_into(ids[:2], mixed) == [True, True]
        assert bytes(mixed[0]) == host_bytes(payloads[0])
        assert host_bytes(mixed[1]) == host_bytes(payloads[1])
        # a device buffer of the wrong size: refused, and the connection stays in step
        wrong = [torch.zeros(BLOCK + 2, dtype=torch.uint8, device=device)]
        with pytest.raises(PayloadSizeError):
            client.load_into(ids[:1], wrong)
        assert client.load_into(ids[:1], out[:1]) == [True]


# -- the lease and the device copy -----------------------------------------------------------


@pytest.fixture
def local_node(tmp_path: Path) -> Iterator[CacheNode]:
    """A node in this process, so that the test can reuse a slot the instant its lease ends."""
    settings = Settings(data_dir=tmp_path / "data", cpu_bytes=512 << 20, disk_bytes=0)
    node = open_node(settings, start=False)
    yield node
    node.close()


BIG = 64 << 20
"""A block whose copy to a device takes milliseconds: one still in flight would show."""


def test_a_lease_is_released_only_once_the_device_copy_is_complete(
    local_node: CacheNode, device: torch.device
) -> None:
    server = open_samehost_server(local_node, local_node.settings)
    if server is None:
        pytest.skip("no shared-memory CPU tier on this platform")
    server.start()
    tier = local_node.store.tiers[0]
    assert isinstance(tier, SharedCpuTier)
    try:
        with SameHostClient.connect(server.address) as client:
            root = client.resolve(ns(device))
            first = pattern(1, BIG, torch.device("cpu"))
            ids = client.block_hashes(root, tokens(9, 2))
            assert client.store(root, tokens(9, 1), [first]).kept == 1
            found = client.locate(root, ids[:1], lease_ms=30_000)
            where = tier.locate(BlockHash(ids[0]))
            assert where is not None and found.slots[0].offset == where.offset
            dst = torch.zeros(BIG, dtype=torch.uint8, device=device)

            at_release: list[bool] = []
            release = client.release_checked

            def release_then_reuse(lease: object) -> bool:
                # Every copy onto the device is over when the lease ends...
                at_release.append(_copies_idle(device))
                live = release(lease)  # type: ignore[arg-type]
                # ...and the node may reuse the slot at once: its last bytes first (where a
                # copy still in flight would read last), then a new block in it.
                slot = tier.get(BlockHash(ids[0]))
                assert slot is not None
                slot[-(1 << 20) :].fill_(0xFF)
                local_node.store.writes.delete([BlockHash(ids[0])])
                tier.put(PutItem(BlockHash(ids[1]), pattern(2, BIG, torch.device("cpu")), root))
                return live

            client.release_checked = release_then_reuse  # type: ignore[method-assign]
            assert client.load_into(found, [dst]) == [True]
            assert at_release == [True]
            reused = tier.locate(BlockHash(ids[1]))
            assert reused is not None and reused.offset == where.offset, "the same slot"
            assert host_bytes(dst) == host_bytes(first)
    finally:
        server.stop()


def _copies_idle(device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    from sessioncache.devices import _copy_stream

    return bool(_copy_stream(device).query())
