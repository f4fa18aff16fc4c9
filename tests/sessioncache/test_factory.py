"""A node as ``open_node`` wires it: what outlives the process goes to the catalog."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from sessioncache.catalog import Catalog
from sessioncache.config import Settings
from sessioncache.errors import QuotaExceeded
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


REDIS_URL = "redis://127.0.0.1:6379/0"


def _resources(tmp_path: Path) -> set[str]:
    """What this process holds open of a node's: files under ``tmp_path``, memfd segments."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(tmp_path)) or target.startswith("/memfd:"):
                held.add(target)
    return held


def _threads_gone(before: set[threading.Thread], timeout_s: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        extra = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.05)


def test_a_start_that_fails_late_closes_every_part_it_built(tmp_path: Path):
    settings = Settings(
        data_dir=tmp_path,
        cpu_bytes=4 << 20,
        disk_bytes=8 << 20,
        redis_url=REDIS_URL,
        redis_prefix=f"factory-{uuid.uuid4().hex[:8]}:",
        # the last step fails: the dashboard's history, after everything else has started
        history_interval_s=10.0,
        history_span_s=1.0,
    )
    node = open_node(settings.model_copy(update={"history_span_s": 3600.0}), start=False)
    node.close()  # the catalog is made and migrated: what is left to see is the start
    before_threads = set(threading.enumerate())
    before_files = _resources(tmp_path)
    with pytest.raises(ValueError, match="history"):
        open_node(settings, start=True)
    assert _threads_gone(before_threads) == []  # write-behind, sweeper, fleet, flusher, ...
    assert _resources(tmp_path) - before_files == set()  # tier segments, catalog files


def test_the_parts_are_built_with_the_tenants_bounds(tmp_path: Path):
    settings = Settings(
        data_dir=tmp_path,
        cpu_bytes=1 << 20,
        disk_bytes=4 << 20,
        api_keys={"k1": "alice", "k2": "bob"},
        tenant_write_behind_share=0.5,
        tenant_limits={"bob": {"write_behind_share": 0.125, "namespaces": 1, "sessions": 1}},
    )
    node = open_node(settings, start=False)
    try:
        behind = node.store.write_behind
        assert behind is not None
        bound = settings.write_behind_bytes
        assert behind.tenant_bytes("alice") == bound // 2
        assert behind.tenant_bytes("bob") == bound // 8
        root = node.namespace_root("bob", NS)
        assert behind.owner(root) == "bob"  # whose share his blocks take
        with pytest.raises(QuotaExceeded):
            node.namespace_root("bob", Namespace("other-model", 4, "bf16", "x"))
        node.sessions.open("s1", tenant="bob")
        with pytest.raises(QuotaExceeded):
            node.sessions.open("s2", tenant="bob")
        assert node.quotas.usage()["write_behind_share"] == {}
    finally:
        node.close()
