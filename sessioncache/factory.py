"""Build a ``TieredStore`` from ``Settings``: the one place that knows which tiers exist."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sessioncache.catalog.reconcile import CatalogRecoveredTier, reconcile
from sessioncache.catalog.writer import Catalog
from sessioncache.clock import Clock
from sessioncache.config import Settings
from sessioncache.events import StoreObserver
from sessioncache.service import CacheNode
from sessioncache.sessions import SessionManager
from sessioncache.store import TieredStore
from sessioncache.sweeper import Sweeper
from tiers.base import RecoverableTier, Tier
from tiers.cpu import CpuTier
from tiers.disk import DiskTier
from tiers.gpu import GpuTier

log = logging.getLogger("sessioncache.factory")


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


def open_node(settings: Settings, *, clock: Clock | None = None, start: bool = True) -> CacheNode:
    """Everything one node runs: catalog (migrated when asked), tiers reconciled with it,
    store, sessions restored, and (``start``) the catalog flusher and the background sweep."""
    catalog = Catalog.open(
        settings.catalog_url(),
        schema=settings.database_schema,
        migrate=settings.migrate_on_start,
        flush_interval_s=settings.catalog_flush_interval_s,
        clock=clock,
    )
    try:
        tiers: list[Tier] = []
        for tier in build_tiers(settings):
            # the catalog restores the LRU order (last access) the files do not record
            tiers.append(
                CatalogRecoveredTier(tier, catalog) if isinstance(tier, RecoverableTier) else tier
            )
        store = TieredStore(
            tiers,
            clock=clock,
            default_ttl_s=settings.default_ttl_s,
            promote_on_get=settings.promote_on_get,
            max_lease_s=settings.max_lease_s,
            observers=[catalog],
        )
        reconcile(catalog, store, verify=settings.reconcile_verify)
        sessions = SessionManager(
            store,
            kind_ttls=settings.kind_ttls(),
            idle_timeout_s=settings.idle_timeout_s,
            pin_share=settings.pin_share,
            repository=catalog,
        )
        restored = sessions.restore()
        log.info("catalog %s: %d sessions restored", catalog_label(settings), restored)
    except BaseException:
        catalog.close()
        raise
    sweeper = Sweeper(sessions, settings.sweep_interval_s)
    if start:
        catalog.start()
        sweeper.start()
    return CacheNode(settings, store, sessions, on_close=[sweeper.stop, catalog.close])


def catalog_label(settings: Settings) -> str:
    """The catalog URL without a password, for logs."""
    url = settings.catalog_url()
    head, sep, tail = url.partition("@")
    if sep and ":" in head.split("//", 1)[-1]:
        scheme, _, creds = head.partition("//")
        return f"{scheme}//{creds.split(':', 1)[0]}:***@{tail}"
    return url
