"""One sessioncache node: the store, sessions, upload slots, namespace ownership, token
accounting and miss attribution, the state every carrier's operations share. The operations
themselves (lookup, load, store, ...) are ``sessioncache.operations``: one implementation each,
which the REST API, the stream and the same-host socket all call.

Tenancy: with authentication on, the namespace salt a request names is never used alone
(``hashing.tenant_namespace``), so two tenants sending the same tokens get different ids and
can never read, hit or overwrite each other's blocks. A node serves a block only to the tenant
owning the block's root (``tenancy.NamespaceOwners``, kept in the catalog).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from sessioncache.accounting import TokenAccounting, TokenCounts
from sessioncache.attribution import Attribution, DropLog, StoreView
from sessioncache.codecs import CodecTable
from sessioncache.config import Settings
from sessioncache.errors import InvalidInput, Unavailable
from sessioncache.fleet import FleetIndex
from sessioncache.hashing import (
    BlockHash,
    Namespace,
    block_hashes_from_bytes,
    tenant_namespace,
)
from sessioncache.history import Sample, StatsHistory, TierSample
from sessioncache.quotas import Counts, PinBudget, Quotas, TenantLimits
from sessioncache.sessions.manager import SessionKey, SessionManager
from sessioncache.sessions.prefetch import Prefetcher
from sessioncache.store import TieredStore
from sessioncache.store.events import UsageRecorder
from sessioncache.store.uploads import UploadSlots
from sessioncache.tenancy import NamespaceOwners
from sessioncache.tiers.base import CheckedTier, SharedTier

log = logging.getLogger("sessioncache.node")

OPEN_TENANT = "default"


class HealthCheck(Protocol):
    """Something else the node runs that may keep it from fully serving (a background pass)."""

    def problem(self) -> str | None: ...


def tenant_defaults(settings: Settings) -> TenantLimits:
    """The bounds of a tenant ``tenant_limits`` says nothing of."""
    return TenantLimits(
        upload_slots=settings.tenant_upload_slots,
        stream_connections=settings.tenant_stream_connections,
        http_connections=max(1, int(settings.http_tenant_share * settings.http_max_connections)),
        inflight_bytes=settings.tenant_inflight_bytes,
        engines=settings.max_engines_per_tenant,
        namespaces=settings.tenant_namespaces,
        sessions=settings.tenant_sessions,
        pin_share=settings.tenant_pin_share,
        write_behind_share=settings.tenant_write_behind_share,
    )


class TenantPins:
    """What each tenant pins, per tier, and the budget its next lasting pin (a lease, a
    session pin, a staging) is admitted against (``quotas.PinBudget``): the blocks under the
    roots it owns that anything pins (``owners``, ``store``) and its same-host stagings
    (``staged``, bytes held in the shared-memory tier)."""

    def __init__(
        self,
        store: TieredStore,
        owners: NamespaceOwners,
        quotas: Quotas,
        staged: Counts | None = None,
    ) -> None:
        self._store = store
        self.owners = owners
        self._quotas = quotas
        self.staged = staged if staged is not None else Counts()
        """Bytes of same-host staging each tenant holds: counted with its pins."""

    def of(self, tenant: str) -> list[int]:
        """Per tier, the bytes the tenant's pins (leases, sessions) and stagings hold."""
        store = self._store
        pinned = store.reads.pinned_under(self.owners.roots(tenant))
        shm = store.shared_memory_tier_name
        if shm is not None:
            pinned[store.tier_names().index(shm)] += self.staged.get(tenant)
        return pinned

    def shares(self) -> dict[str, float]:
        """Per tenant owning blocks, the largest share of a tier its pinned blocks hold."""
        tiers = self._store.tiers
        out: dict[str, float] = {}
        for tenant in self.owners.per_tenant():
            share = max(
                (
                    n / t.capacity_bytes
                    for n, t in zip(self.of(tenant), tiers, strict=True)
                    if t.capacity_bytes
                ),
                default=0.0,
            )
            if share:
                out[tenant] = share
        return out

    def budget(self, tenant: str, *, locate: bool = False) -> PinBudget:
        """What a lasting pin for ``tenant`` is admitted against: its ``pin_share`` of each
        tier, less its pins and stagings. ``locate``: the granted blocks are then copied into
        the shared-memory tier."""
        store = self._store
        shm = store.shared_memory_tier_name
        tier = store.tier_names().index(shm) if shm is not None else None
        return self._quotas.pins(
            tenant,
            self.owners.roots(tenant),
            staged=self.staged,
            staged_tier=tier,
            into=tier if locate else None,
        )


def make_prefetcher(
    settings: Settings,
    store: TieredStore,
    sessions: SessionManager,
    pins: TenantPins,
    *,
    returns: Callable[[SessionKey], float | None] | None = None,
) -> Prefetcher:
    """The node's prefetch engine, its grants admitted against ``pins``' budgets
    (``returns``: known returns instead of the forecast, for a replay's oracle)."""
    return Prefetcher(
        store,
        sessions,
        budget=pins.budget,
        tenant_of=pins.owners.tenant_of,
        forecast=settings.prefetch_forecast,
        hold_s=min(settings.prefetch_hold_s, settings.max_lease_s),
        returns=returns,
    )


class CacheNode:
    """The shared state of one node (see module docstring)."""

    def __init__(
        self,
        settings: Settings,
        store: TieredStore,
        sessions: SessionManager,
        *,
        on_close: Sequence[Callable[[], None]] = (),
        fleet: FleetIndex | None = None,
        owners: NamespaceOwners | None = None,
        usage: UsageRecorder | None = None,
        history: StatsHistory | None = None,
        checks: Sequence[HealthCheck] = (),
        catalog: HealthCheck | None = None,
        codecs: CodecTable | None = None,
        quotas: Quotas | None = None,
        pins: TenantPins | None = None,
        prefetch: Prefetcher | None = None,
    ) -> None:
        """``quotas``, ``owners`` and ``pins`` are the ones ``sessions``, the namespace owners
        and the store's write-behind were built with (``factory.open_node``), so that every
        bound is in force from the start; left out, the node makes its own from ``settings``
        (which bound only what the node itself grants: parts built without them are
        unbounded). ``prefetch``: the prefetch engine (``factory.open_node`` starts it);
        left out, one is made here, unstarted (its moves run by ``drain``)."""
        self.settings = settings
        self.codecs = codecs if codecs is not None else CodecTable()
        """How the lower tiers store each namespace's blocks (``sessioncache.codecs``)."""
        self.store = store
        self.sessions = sessions
        if quotas is None:
            quotas = Quotas(tenant_defaults(settings), settings.tenant_limits)
        self.quotas = quotas
        """Each tenant's bounds (``quotas.TenantLimits``)."""
        self.uploads = UploadSlots(
            store.clock,
            ttl_s=settings.upload_ttl_s,
            limit=lambda tenant: quotas.of(tenant).upload_slots,
        )
        self.inflight = quotas.tally("inflight_bytes")
        """Receive-buffer bytes each tenant's requests hold now (``Tally.charge``)."""
        self.owners = owners or NamespaceOwners()
        self.pins = pins or TenantPins(store, self.owners, quotas)
        """What each tenant pins, and the budget of its next pin."""
        self.staged = self.pins.staged
        self.prefetch = prefetch or make_prefetcher(settings, store, sessions, self.pins)
        """Moves sessions' chains up into the CPU tier ahead of their return
        (``sessions.prefetch``)."""
        """Bytes of same-host staging each tenant holds: counted with its pins."""
        quotas.count("namespaces", self.owners.per_tenant)
        quotas.count("sessions", sessions.tenants.snapshot)
        quotas.count("pin_share", self.pins.shares)
        self.received = Counts()
        """Block payload bytes received, per carrier (``rest``, ``stream``, ``same_host``)."""
        quotas.count("upload_slots", self.uploads.per_tenant)
        behind = store.write_behind
        if behind is not None:
            bound = behind.bound_bytes
            quotas.count(
                "write_behind_share",
                lambda: {t: n / bound for t, n in behind.tenants.snapshot().items()},
            )
        self._roots: dict[tuple[str, Namespace], bytes] = {}
        self._lock = threading.Lock()
        self._on_close = list(on_close)
        self.fleet = fleet
        self.accounting = TokenAccounting(usage)
        self.history = history
        self._checks = list(checks)
        self._catalog = catalog  # the catalog's health (``catalog.health.CatalogHealth``)
        self._shared_tier = any(isinstance(t, SharedTier) for t in store.tiers)
        drops = DropLog(settings.attribution_ring_blocks)
        store.observe(drops)
        self.attribution = Attribution(
            StoreView(store.reads.meta, store.reads.where, store.clock.now),
            drops,
            max_sessions=settings.attribution_sessions,
        )
        sessions.on_unpin(self.attribution.unpinned)

    def pin_budget(self, tenant: str, *, locate: bool = False) -> PinBudget:
        """What a lasting pin for ``tenant`` (a lease, a session pin, a staging) is admitted
        against (``TenantPins.budget``)."""
        return self.pins.budget(tenant, locate=locate)

    def token_counts(self) -> TokenCounts:
        """Prompt tokens looked up so far, on every path: found in the cache (hit) or not."""
        return self.accounting.totals()

    def namespace_tokens(self) -> dict[bytes, TokenCounts]:
        """Hit and miss tokens per namespace root, since the process started."""
        return self.accounting.per_namespace()

    def session_hit_tokens(self, sessions: Sequence[SessionKey]) -> dict[SessionKey, int]:
        """Hit tokens of lookups naming each session, since the process started."""
        return self.accounting.session_hits(sessions)

    def describe_root(self, root: bytes) -> tuple[str, dict[str, object]] | None:
        """(tenant, namespace fields) of a namespace root, when known."""
        return self.owners.describe(root)

    def sample(self) -> Sample:
        """The figures the stats history keeps (``history.Sample``)."""
        counters = self.store.counters()
        tokens = self.token_counts()
        return Sample(
            at=self.store.clock.now(),
            hit_tokens=tokens.hit,
            miss_tokens=tokens.miss,
            lookups=counters.lookups,
            puts=counters.puts,
            stored_blocks=counters.stored_blocks,
            loaded_bytes=counters.loaded_bytes,
            evictions=counters.evictions,
            demotions=counters.demotions,
            expirations=counters.expirations,
            corrupt_reads=counters.corrupt_reads,
            sessions=self.sessions.count(),
            tiers=tuple(
                TierSample(t.name, t.used_bytes, t.capacity_bytes, t.pinned_bytes, t.blocks)
                for t in self.store.stats_tiers()
            ),
        )

    @property
    def durable_uploads(self) -> bool:
        return self.settings.durable_uploads and any(t.durable for t in self.store.tiers)

    @property
    def auth_enabled(self) -> bool:
        return bool(self.settings.api_keys)

    def tenant_for_key(self, key: str | None) -> str | None:
        """The tenant of an API key; the open tenant when auth is off; None when refused."""
        if not self.auth_enabled:
            return OPEN_TENANT
        if key is None:
            return None
        return self.settings.api_keys.get(key)

    def effective_namespace(self, tenant: str, namespace: Namespace) -> Namespace:
        return tenant_namespace(namespace, tenant if self.auth_enabled else None)

    def namespace_root(self, tenant: str, namespace: Namespace) -> bytes:
        """The root of the tenant's effective namespace, remembered as owned by the tenant."""
        key = (tenant, namespace)
        with self._lock:
            root = self._roots.get(key)
            if root is not None:
                return root
        root = self.effective_namespace(tenant, namespace).root(self.settings.hash_seed)
        self.owners.claim(root, tenant, namespace)
        self.codecs.remember(root, namespace, tenant)
        with self._lock:
            if len(self._roots) > 100_000:
                self._roots.clear()
            self._roots[key] = root
        return root

    def lookup_waits_on_io(
        self, tenant: str, namespace: Namespace, *, session_id: str | None
    ) -> bool:
        """Whether a lookup may wait on I/O, not only compute under locks: a tenant's first
        use of a namespace (its root is recorded in the catalog), a session's (sessions are
        saved to the catalog), any with a shared tier (a short match asks Redis). The API
        runs the others on its event loop instead of a worker thread."""
        if session_id is not None or self._shared_tier:
            return True
        with self._lock:
            return (tenant, namespace) not in self._roots

    def hashes(self, tenant: str, namespace: Namespace, token_bytes: bytes) -> list[BlockHash]:
        if len(token_bytes) // 4 > self.settings.max_tokens:
            raise InvalidInput(
                f"{len(token_bytes) // 4} tokens exceed the limit of {self.settings.max_tokens}"
            )
        root = self.namespace_root(tenant, namespace)
        return block_hashes_from_bytes(
            root, token_bytes, namespace.block_tokens, self.settings.hash_seed
        )

    def health_problems(self) -> list[str]:
        """Why this node cannot fully serve right now (empty when it can)."""
        problems = []
        if self.fleet is not None:
            problem = self.fleet.problem()
            if problem:
                problems.append(f"fleet index: {problem}")
        for tier in self.store.tiers:
            if isinstance(tier, CheckedTier):
                problem = tier.problem()
                if problem:
                    problems.append(f"{tier.name}: {problem}")
        for check in [*self._checks, *([self._catalog] if self._catalog else [])]:
            problem = check.problem()
            if problem:
                problems.append(problem)
        behind = self.store.write_behind
        if behind is not None and behind.degraded():
            problems.append(
                f"write-behind: {behind.backlog_bytes} of {behind.bound_bytes} bytes queued for "
                "disk for 10 s or more (the disk is slower than the stores)"
            )
        return problems

    def dependencies(self) -> dict[str, str]:
        """What the node stands on outside its memory, each ``ok`` or why it fails now: the
        catalog, the durable and shared tiers (by name), the fleet index."""
        out = {"catalog": (self._catalog.problem() if self._catalog else None) or "ok"}
        for tier in self.store.tiers:
            if tier.durable or isinstance(tier, SharedTier):
                problem = tier.problem() if isinstance(tier, CheckedTier) else None
                out[tier.name] = problem or "ok"
        if self.fleet is not None:
            out["fleet index"] = self.fleet.problem() or "ok"
        return out

    def locations(self, hashes: Sequence[BlockHash]) -> list[dict[str, list[str]]] | None:
        """For each id, which nodes of the fleet hold it and in which tiers (None without a
        fleet index)."""
        if self.fleet is None:
            return None
        return self.fleet.locations(hashes)

    def close(self) -> None:
        self.prefetch.stop()
        if self.history is not None:
            self.history.stop()
        for hook in self._on_close:
            try:
                hook()
            except Unavailable as exc:  # the catalog down: what it queued is not written
                log.warning("while closing: %s", exc)
            except Exception:
                log.exception("error while closing")
        self.store.close()
