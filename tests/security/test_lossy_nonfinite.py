"""A lossy namespace keeps a group holding an Inf or a NaN exact: one non-finite value in a
tenant's block costs that group its compression, never its 63 neighbours' values, and
another tenant's blocks on the same disk read back as they were coded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from sessioncache.connector import StreamClient, discover
from sessioncache.hashing import Namespace
from tests.security.conftest import NodeFactory
from tests.support.servers import DURABLE_NODE

LOSSY = Namespace("nonfinite", 16, "bf16", "x", kv_codec="int8/64")
BLOCK = 64 * 1024
KEYS = {"alice": "key-alice", "bob": "key-bob"}


def kv(seed: int, poison: bool) -> np.ndarray:
    x = torch.randn(BLOCK // 2, generator=torch.Generator().manual_seed(seed)) * 0.5
    if poison:
        x[10] = float("inf")
        x[64 * 7 + 3] = float("nan")
    return x.to(torch.bfloat16).view(torch.uint8).numpy()


def tokens(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, 16).astype(np.uint32)


def store(url: str, who: str, seed: int, block: np.ndarray) -> None:
    key = KEYS[who]
    with StreamClient.connect(discover(url, api_key=key), api_key=key, timeout=30) as c:
        assert c.store(c.resolve(LOSSY), tokens(seed), [block], durable=True).kept == 1


def load(url: str, who: str, seed: int) -> torch.Tensor:
    key = KEYS[who]
    with StreamClient.connect(discover(url, api_key=key), api_key=key, timeout=30) as c:
        root = c.resolve(LOSSY)
        (got,) = c.load(c.block_hashes(root, tokens(seed)))
    assert got is not None
    return torch.frombuffer(bytearray(got), dtype=torch.bfloat16)


def test_inf_and_nan_keep_their_group_exact_through_the_disk(
    guarded_node: NodeFactory, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    node = guarded_node(DURABLE_NODE, data_dir=data)
    bob_block, alice_block = kv(1, poison=True), kv(2, poison=False)
    store(node.url, "bob", 1, bob_block)
    store(node.url, "alice", 2, alice_block)
    node.stop()
    node = guarded_node(DURABLE_NODE, data_dir=data)  # an empty CPU tier: loads read disk
    bob = load(node.url, "bob", 1)
    want = torch.from_numpy(bob_block.copy()).view(torch.bfloat16)
    rows, want_rows = bob.view(-1, 64), want.view(-1, 64)
    for g in (0, 7):  # the groups holding the Inf and the NaN: byte-exact
        assert rows[g].view(torch.uint8).tolist() == want_rows[g].view(torch.uint8).tolist()
    others = [g for g in range(rows.shape[0]) if g not in (0, 7)]
    assert int((~torch.isfinite(rows[others])).sum()) == 0
    assert float((rows[others].float() - want_rows[others].float()).abs().max()) < 0.05
    alice = load(node.url, "alice", 2).float()
    assert (
        float((alice - torch.from_numpy(alice_block.copy()).view(torch.bfloat16)).abs().max())
        < 0.05
    )
