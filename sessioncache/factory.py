"""Build a ``TieredStore`` from ``Settings``: the one place that knows which tiers exist."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import ExitStack

from sessioncache.catalog.reconcile import BackgroundReconcile, CatalogRecoveredTier, reconcile
from sessioncache.catalog.repository import Catalog
from sessioncache.clock import Clock
from sessioncache.codecs import CodecTable
from sessioncache.config import Settings
from sessioncache.errors import InvalidInput
from sessioncache.fleet import FleetIndex, FleetObserver
from sessioncache.history import StatsHistory
from sessioncache.node import CacheNode, TenantPins, make_prefetcher, tenant_defaults
from sessioncache.quotas import Counts, Quotas
from sessioncache.redis_link import client_factory
from sessioncache.sessions.manager import SessionManager
from sessioncache.sessions.sweeper import sweeper
from sessioncache.store import TieredStore
from sessioncache.store.events import StoreObserver
from sessioncache.store.eviction import EvictionPolicy
from sessioncache.store.shared_expiry import SharedExpiryRefresher
from sessioncache.tenancy import NamespaceOwners
from sessioncache.tiers.base import LazyStartTier, RecoverableTier, Tier
from sessioncache.tiers.cpu import CpuTier, SharedCpuTier, shared_memory_available
from sessioncache.tiers.disk import DiskTier
from sessioncache.tiers.gpu import GpuTier
from sessioncache.tiers.redis import RedisTier
from sessioncache.tiers.slab import DEFAULT_CHUNK_BYTES, SlabTier

log = logging.getLogger("sessioncache.factory")


def build_tiers(
    settings: Settings, *, scan: bool = True, codecs: CodecTable | None = None
) -> list[Tier]:
    """The configured tiers, fastest first; a capacity of 0 leaves a tier out. With a Redis
    URL and the write-back policy the shared tier comes last, below the local ones (it gets
    their victims); with write-through it is last too and also written on every put.
    ``scan=False`` opens the disk tier without reading its files (a fast restart);
    ``codecs``: how the disk tier stores each namespace's blocks (default: the settings')."""
    if codecs is None:
        codecs = codec_table(settings)
    tiers: list[Tier] = []
    with ExitStack() as opened:  # a tier that fails to open closes those before it
        opened.callback(close_tiers, tiers)
        if settings.gpu_bytes:
            tiers.append(GpuTier(settings.gpu_bytes, device=settings.gpu_device))
        if settings.cpu_bytes:
            prealloc = settings.cpu_preallocate == "wait"
            spare = (  # "background": every chunk that fits, kept made
                settings.cpu_bytes // DEFAULT_CHUNK_BYTES
                if settings.cpu_preallocate == "background"
                else settings.cpu_spare_chunks
            )
            tiers.append(
                SharedCpuTier(
                    settings.cpu_bytes,
                    spare_chunks=spare,
                    preallocate=prealloc,
                    register_cuda=bool(settings.gpu_bytes),
                )
                if shared_cpu_tier(settings)
                else CpuTier(settings.cpu_bytes, spare_chunks=spare, preallocate=prealloc)
            )
        if settings.disk_bytes:
            tiers.append(
                DiskTier.open(
                    settings.data_dir / "blocks", settings.disk_bytes, scan=scan, codecs=codecs
                )
            )
        if settings.redis_url:
            tiers.append(
                RedisTier(
                    client_factory(settings.redis_url),
                    settings.redis_bytes,
                    prefix=settings.redis_prefix,
                    default_ttl_s=settings.default_ttl_s,
                    codecs=codecs,
                )
            )
        if not tiers:
            raise InvalidInput("every tier is disabled: give at least one a capacity")
        opened.pop_all()
    return tiers


def close_tiers(tiers: Sequence[Tier]) -> None:
    """Close each of ``tiers``, the last first (a store that was never made owns none)."""
    for tier in reversed(tiers):
        try:
            tier.close()
        except Exception:
            log.exception("closing tier %s", tier.name)


def codec_table(settings: Settings) -> CodecTable:
    """Which codec each namespace's blocks get below the memory tiers (``codecs``)."""
    return CodecTable(settings.disk_codec, settings.tenant_codecs)


def shared_cpu_tier(settings: Settings) -> bool:
    """Whether the CPU tier goes into shared memory (the same-host path): asked for
    (``SESSIONCACHE_SHM``) and possible here (Linux). With a GPU tier its segments are
    registered with CUDA as they are made, as a pinned tier's memory would be."""
    if not settings.shm or not settings.cpu_bytes:
        return False
    if not shared_memory_available():
        log.info("SESSIONCACHE_SHM: no memfd on this platform; the same-host path is off")
        return False
    return True


def build_store(
    settings: Settings, *, clock: Clock | None = None, observers: Sequence[StoreObserver] = ()
) -> TieredStore:
    """Open the tiers and index what the durable ones hold."""
    tiers = build_tiers(settings)
    with ExitStack() as opened:
        opened.callback(close_tiers, tiers)
        store = TieredStore(
            tiers,
            clock=clock,
            default_ttl_s=settings.default_ttl_s,
            promote_on_get=settings.promote_on_get,
            max_lease_s=settings.max_lease_s,
            observers=observers,
            write_behind_bytes=settings.write_behind_bytes,
            write_behind_share=lambda tenant: settings.tenant_write_behind_share,
            room_wait_s=settings.store_room_wait_s,
        )
        opened.pop_all()
    return store


def open_node(settings: Settings, *, clock: Clock | None = None, start: bool = True) -> CacheNode:
    """Everything one node runs: catalog (migrated when asked), tiers reconciled with it,
    store, sessions restored, the fleet index when Redis is configured, and (``start``) the
    catalog flusher, the fleet's heartbeat and the background sweep.

    A started node restarts fast: the disk tier's index is the catalog's rows,
    files unopened, and the files the catalog lacks are adopted by a background pass while
    the node serves (``/readyz`` says so meanwhile). Unstarted (commands, tests) it walks
    and reconciles everything before returning, as before.

    All or nothing: when a step raises, every part built before it is closed (its threads
    stopped, its tiers and catalog closed) before the error propagates; the node returned
    closes them all in ``CacheNode.close``."""
    fast = start
    with ExitStack() as undo:
        catalog = Catalog.open(
            settings.catalog_url(),
            schema=settings.database_schema,
            migrate=settings.migrate_on_start,
            flush_interval_s=settings.catalog_flush_interval_s,
            clock=clock,
            wait_s=settings.catalog_wait_s,
        )
        undo.callback(catalog.close)
        codecs = codec_table(settings)
        quotas = Quotas(tenant_defaults(settings), settings.tenant_limits)
        owners = NamespaceOwners(catalog, admit=quotas.admitter("namespaces"))
        with ExitStack() as opened:  # the tiers, until the store owns them
            built = build_tiers(settings, scan=not fast, codecs=codecs)
            opened.callback(close_tiers, built)
            tiers: list[Tier] = []
            for tier in built:
                # the catalog restores the LRU order (last access) the files do not record
                tiers.append(
                    CatalogRecoveredTier(
                        tier, catalog, from_catalog=fast and isinstance(tier, LazyStartTier)
                    )
                    if isinstance(tier, RecoverableTier)
                    else tier
                )
            observers: list[StoreObserver] = [catalog]
            fleet: FleetIndex | None = None
            refresher: SharedExpiryRefresher | None = None
            shared = next((t for t in tiers if isinstance(t, RedisTier)), None)
            if shared is not None and settings.redis_url:
                fleet = FleetIndex(
                    client_factory(settings.redis_url),
                    settings.node_id,
                    prefix=settings.redis_prefix,
                    ttl_s=settings.fleet_ttl_s,
                    info={"url": settings.node_url or f"http://{settings.host}:{settings.port}"},
                )
                refresher = SharedExpiryRefresher(shared, shared.name)
                observers += [
                    FleetObserver(fleet, exclude=[shared.name]),
                    refresher,
                ]
            write_through = (
                [shared.name]
                if shared is not None and settings.redis_write_policy == "write_through"
                else []
            )
            store = TieredStore(
                tiers,
                EvictionPolicy.named(settings.eviction_policy, len(tiers)),
                clock=clock,
                default_ttl_s=settings.default_ttl_s,
                promote_on_get=settings.promote_on_get,
                max_lease_s=settings.max_lease_s,
                observers=observers,
                write_through=write_through,
                write_behind_bytes=settings.write_behind_bytes,
                write_behind_owner=owners.tenant_of,
                write_behind_share=quotas.write_behind_share,
                room_wait_s=settings.store_room_wait_s,
            )
            opened.pop_all()
        undo.callback(store.close)
        if refresher is not None and shared is not None:
            refresher.bind(store.tier_names().index(shared.name))
        if fleet is not None and shared is not None:
            shared_name = shared.name
            fleet.set_held(
                lambda: [held for held in store.reads.holdings() if held[1] != shared_name]
            )
        background: BackgroundReconcile | None = None
        if fast:
            catalog.bind_tiers(store.tiers)
            background = BackgroundReconcile(store, verify=settings.reconcile_verify)
        else:
            reconcile(catalog, store, verify=settings.reconcile_verify)
        staged = Counts()
        pins = TenantPins(store, owners, quotas, staged)
        sessions = SessionManager(
            store,
            kind_ttls=settings.kind_ttls(),
            idle_timeout_s=settings.idle_timeout_s,
            pin_share=settings.pin_share,
            pins_follow_forecast=settings.pins_follow_forecast,
            repository=catalog.sessions,
            admit=quotas.admitter("sessions"),
            budget=pins.budget,
            pinned_of=pins.of,
        )
        restored = sessions.restore()
        owned = owners.load()
        log.info(
            "catalog %s: %d sessions, %d tenant namespaces restored",
            catalog_label(settings),
            restored,
            owned,
        )
        sweep = sweeper(sessions, settings.sweep_interval_s)
        on_close: list[Callable[[], None]] = [sweep.stop]
        if background is not None:
            undo.callback(background.close)
            background.start()
            on_close.append(background.close)
        if start:
            for tier in tiers:
                if isinstance(tier, SlabTier):
                    tier.make_ahead()  # a serving node makes its memory from start
            catalog.start()
            undo.callback(sweep.stop)
            sweep.start()
            if fleet is not None:
                undo.callback(fleet.stop)
                fleet.start()
            if refresher is not None:
                undo.callback(refresher.stop)
                refresher.start()
        if fleet is not None:
            on_close.append(fleet.stop)
        if refresher is not None:
            on_close.append(refresher.stop)
        on_close.append(catalog.close)
        node = CacheNode(
            settings,
            store,
            sessions,
            on_close=on_close,
            fleet=fleet,
            owners=owners,
            usage=catalog,
            checks=[background] if background is not None else [],
            catalog=catalog.health,
            codecs=codecs,
            quotas=quotas,
            pins=pins,
            prefetch=make_prefetcher(settings, store, sessions, pins),
        )
        # the dashboard's charts: the node stops it when it closes
        node.history = StatsHistory(
            node.sample, interval_s=settings.history_interval_s, span_s=settings.history_span_s
        )
        if start:
            undo.callback(node.history.stop)
            node.history.start()
            undo.callback(node.prefetch.stop)
            node.prefetch.start()
        undo.pop_all()
    return node


def catalog_label(settings: Settings) -> str:
    """The catalog URL without a password, for logs."""
    url = settings.catalog_url()
    head, sep, tail = url.partition("@")
    if sep and ":" in head.split("//", 1)[-1]:
        scheme, _, creds = head.partition("//")
        return f"{scheme}//{creds.split(':', 1)[0]}:***@{tail}"
    return url
