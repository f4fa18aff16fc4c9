"""Build a ``TieredStore`` from ``Settings``: the one place that knows which tiers exist."""

from __future__ import annotations

from collections.abc import Sequence

from sessioncache.clock import Clock
from sessioncache.config import Settings
from sessioncache.events import StoreObserver
from sessioncache.service import CacheNode
from sessioncache.sessions import SessionManager
from sessioncache.store import TieredStore
from sessioncache.sweeper import Sweeper
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


def build_store(
    settings: Settings, *, clock: Clock | None = None, observers: Sequence[StoreObserver] = ()
) -> TieredStore:
    """Open the tiers and index what the durable ones hold."""
    return TieredStore(
        build_tiers(settings),
        clock=clock,
        default_ttl_s=settings.default_ttl_s,
        promote_on_get=settings.promote_on_get,
        max_lease_s=settings.max_lease_s,
        observers=observers,
    )


def open_node(settings: Settings, *, clock: Clock | None = None) -> CacheNode:
    """Everything one node runs, started: tiers, store, sessions and the background sweep."""
    store = build_store(settings, clock=clock)
    sessions = SessionManager(
        store,
        kind_ttls=settings.kind_ttls(),
        idle_timeout_s=settings.idle_timeout_s,
        pin_share=settings.pin_share,
    )
    sweeper = Sweeper(sessions, settings.sweep_interval_s)
    sweeper.start()
    return CacheNode(settings, store, sessions, on_close=[sweeper.stop])
