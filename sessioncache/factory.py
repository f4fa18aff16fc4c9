"""Build a ``TieredStore`` from ``Settings``: the one place that knows which tiers exist."""

from __future__ import annotations

from sessioncache.clock import Clock
from sessioncache.config import Settings
from sessioncache.store import TieredStore
from tiers.base import Tier
from tiers.cpu import CpuTier
from tiers.disk import DiskTier
from tiers.gpu import GpuTier


def build_tiers(settings: Settings) -> list[Tier]:
    """The configured tiers, fastest first; a capacity of 0 leaves a tier out."""
    tiers: list[Tier] = []
    if settings.gpu_bytes:
        tiers.append(GpuTier(settings.gpu_bytes, device=settings.gpu_device))
    if settings.cpu_bytes:
        tiers.append(CpuTier(settings.cpu_bytes))
    if settings.disk_bytes:
        tiers.append(DiskTier.open(settings.data_dir / "blocks", settings.disk_bytes))
    return tiers


def build_store(settings: Settings, *, clock: Clock | None = None) -> TieredStore:
    """Open the tiers and index what the durable ones hold."""
    return TieredStore(
        build_tiers(settings),
        clock=clock,
        default_ttl_s=settings.default_ttl_s,
        promote_on_get=settings.promote_on_get,
        max_lease_s=settings.max_lease_s,
    )
