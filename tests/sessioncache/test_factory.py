"""A node as ``open_node`` wires it: what outlives the process goes to the catalog."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sessioncache.catalog import Catalog
from sessioncache.config import Settings
from sessioncache.factory import open_node, shared_cpu_tier
from sessioncache.hashing import Namespace, tokens_to_le_bytes
from sessioncache.operations import lookups, stores
from sessioncache.operations.caller import Caller

NS = Namespace("factory-model", 4, "bf16", "x")


def test_lookups_record_hit_and_miss_tokens_in_the_catalog_usage(tmp_path: Path):
    settings = Settings(data_dir=tmp_path, cpu_bytes=1 << 20, disk_bytes=4 << 20)
    node = open_node(settings, start=False)
    try:
        tokens = tokens_to_le_bytes(list(range(12)))
        plan = stores.plan_upload(node, Caller("default"), NS, tokens)
        for h in plan.missing[:2]:
            stores.upload(node, Caller("default"), h, b"\x01" * 64)
        lookups.lookup_tokens(
            node, Caller("default"), NS, tokens + tokens_to_le_bytes([7])
        )  # 8 hit, 5 missed
    finally:
        node.close()
    with Catalog.open(settings.catalog_url()) as catalog:
        totals: dict[str, int] = {}
        for sample in catalog.usage(0.0, names=["hit_tokens", "miss_tokens"]):
            totals[sample.name] = totals.get(sample.name, 0) + sample.value
    assert totals == {"hit_tokens": 8, "miss_tokens": 5}


def test_the_cpu_tier_is_in_shared_memory_unless_turned_off(tmp_path: Path):
    from sessioncache.factory import build_tiers
    from sessioncache.tiers.cpu import CpuTier, SharedCpuTier

    shared = build_tiers(Settings(data_dir=tmp_path, cpu_bytes=1 << 20, disk_bytes=0))
    assert [type(t) for t in shared] == [SharedCpuTier]  # Linux: the default
    plain = build_tiers(Settings(data_dir=tmp_path, cpu_bytes=1 << 20, disk_bytes=0, shm=False))
    assert [type(t) for t in plain] == [CpuTier]
    for tier in (*shared, *plain):
        tier.close()


def test_the_cpu_tier_is_preallocated_when_asked(tmp_path: Path):
    from sessioncache.factory import build_tiers

    settings = Settings(
        data_dir=tmp_path, cpu_bytes=(128 << 20) + 4096, disk_bytes=0, cpu_preallocate=True
    )
    for shm in (True, False):
        (tier,) = build_tiers(settings.model_copy(update={"shm": shm}))
        assert tier.spare_bytes == 128 << 20  # type: ignore[attr-defined]  # two 64 MiB chunks
        tier.close()
    (lazy,) = build_tiers(Settings(data_dir=tmp_path, cpu_bytes=128 << 20, disk_bytes=0))
    assert lazy.spare_bytes == 0  # type: ignore[attr-defined]  # made ahead of need only
    lazy.close()


def test_the_cpu_tier_stays_in_shared_memory_where_cuda_is_present(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # CI has no GPU: torch reports one, as a CUDA host's would. Engines on a GPU host get
    # the same-host path, its segments registered with CUDA (tests/gpu, on a GPU).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert shared_cpu_tier(Settings(data_dir=tmp_path, cpu_bytes=1 << 20, disk_bytes=0))
