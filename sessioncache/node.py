"""One sessioncache node: the store, sessions, upload slots and namespace ownership, with the
operations the REST API exposes. HTTP knows nothing of tiers; this module knows nothing of HTTP.

Tenancy: with authentication on, the namespace salt a request names is never used alone
(``hashing.tenant_namespace``), so two tenants sending the same tokens get different ids and
can never read, hit or overwrite each other's blocks. A node serves a block only to the tenant
owning the block's root (``tenancy.NamespaceOwners``, kept in the catalog).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from sessioncache.attribution import (
    Attribution,
    DropLog,
    MissReport,
    StoreView,
)
from sessioncache.blocks import BlockMeta
from sessioncache.config import Settings
from sessioncache.errors import BlockNotFound, InvalidInput, LeaseNotFound, SessionCacheError
from sessioncache.events import UsageRecorder
from sessioncache.fleet import FleetIndex
from sessioncache.hashing import (
    BlockHash,
    Namespace,
    block_hashes_from_bytes,
    tenant_namespace,
)
from sessioncache.history import Sample, StatsHistory, TierSample
from sessioncache.sessions import SessionManager
from sessioncache.store import Match, TieredStore
from sessioncache.tenancy import NamespaceOwners
from sessioncache.tiers.base import CheckedTier, SharedTier
from sessioncache.tiers.payload import Payload, as_memoryview
from sessioncache.uploads import UploadSlots

log = logging.getLogger("sessioncache.node")

OPEN_TENANT = "default"
MAX_TRACKED = 100_000
"""Most namespaces and sessions whose token counts a node keeps in memory."""


class HealthCheck(Protocol):
    """Something else the node runs that may keep it from fully serving (a background pass)."""

    def problem(self) -> str | None: ...


class UploadRefused(SessionCacheError):
    """A payload for an id that was not handed out to this caller (or whose slot expired)."""


@dataclass(frozen=True, slots=True)
class LookupResult:
    block_tokens: int
    hashes: list[BlockHash]
    match: Match
    miss: MissReport | None = None
    """Why the tokens past the match missed (``sessioncache/attribution.py``)."""


@dataclass(slots=True)
class TokenCounts:
    hit: int = 0
    miss: int = 0


@dataclass(frozen=True, slots=True)
class StorePlan:
    block_tokens: int
    hashes: list[BlockHash]
    missing: list[BlockHash]


class CacheNode:
    """The operations of one node (see module docstring)."""

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
    ) -> None:
        self.settings = settings
        self.store = store
        self.sessions = sessions
        self.uploads = UploadSlots(store.clock, ttl_s=settings.upload_ttl_s)
        self._owners = owners or NamespaceOwners()
        self._roots: dict[tuple[str, Namespace], bytes] = {}
        self._lock = threading.Lock()
        self._on_close = list(on_close)
        self.fleet = fleet
        self._tokens = TokenCounts()
        # per namespace root and per session, for the dashboard (bounded: see _count_tokens)
        self._root_tokens: dict[bytes, TokenCounts] = {}
        self._session_hits: dict[str, int] = {}
        self._usage = usage
        self.history = history
        self._checks = list(checks)
        self._shared_tier = any(isinstance(t, SharedTier) for t in store.tiers)
        drops = DropLog(settings.attribution_ring_blocks)
        store.observe(drops)
        self.attribution = Attribution(
            StoreView(store.meta, store.where, store.clock.now),
            drops,
            max_sessions=settings.attribution_sessions,
        )
        sessions.on_unpin(self.attribution.unpinned)

    def token_counts(self) -> TokenCounts:
        """Prompt tokens looked up so far: found in the cache (hit) or not (miss)."""
        with self._lock:
            return replace(self._tokens)

    def namespace_tokens(self) -> dict[bytes, TokenCounts]:
        """Hit and miss tokens per namespace root, since the process started."""
        with self._lock:
            return {root: replace(t) for root, t in self._root_tokens.items()}

    def session_hit_tokens(self, session_ids: Sequence[str]) -> dict[str, int]:
        """Hit tokens of lookups naming each session, since the process started."""
        with self._lock:
            return {sid: self._session_hits.get(sid, 0) for sid in session_ids}

    def describe_root(self, root: bytes) -> tuple[str, dict[str, object]] | None:
        """(tenant, namespace fields) of a namespace root, when known."""
        return self._owners.describe(root)

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
        self._owners.claim(root, tenant, namespace)
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

    # -- data path ----------------------------------------------------------------------

    def lookup(
        self,
        tenant: str,
        namespace: Namespace,
        token_bytes: bytes,
        *,
        session_id: str | None = None,
        lease_s: float | None = None,
    ) -> LookupResult:
        hashes = self.hashes(tenant, namespace, token_bytes)
        match = self._match(tenant, hashes, session_id=session_id, lease_s=lease_s)
        asked = len(token_bytes) // 4
        root = self.namespace_root(tenant, namespace)
        self._count_tokens(
            match.num_blocks * namespace.block_tokens, asked, root=root, session_id=session_id
        )
        miss = self.attribution.lookup(
            root,
            hashes,
            match.num_blocks,
            namespace.block_tokens,
            asked,
            tokens=bytes(token_bytes) if session_id is not None else None,
            session=(session_id, tenant) if session_id is not None else None,
        )
        return LookupResult(namespace.block_tokens, hashes, match, miss)

    def lookup_ids(
        self,
        tenant: str,
        namespace: Namespace,
        hashes: Sequence[BlockHash],
        *,
        session_id: str | None = None,
        lease_s: float | None = None,
    ) -> LookupResult:
        """``lookup`` by block ids the caller computed itself from ``namespace_root`` (no
        re-hashing). The match covers only blocks of the chain rooted at the caller's root
        for ``namespace``: an id of another tenant or namespace, or one that does not follow
        its predecessor, is a miss, and the match stops there (``chain_prefix``)."""
        if len(hashes) * namespace.block_tokens > self.settings.max_tokens:
            raise InvalidInput(
                f"{len(hashes)} blocks of {namespace.block_tokens} tokens exceed the limit of "
                f"{self.settings.max_tokens} tokens"
            )
        root = self.namespace_root(tenant, namespace)
        own = self.chain_prefix(root, hashes)
        match = self._match(tenant, hashes[:own], session_id=session_id, lease_s=lease_s)
        block_tokens = namespace.block_tokens
        self._count_tokens(
            match.num_blocks * block_tokens,
            len(hashes) * block_tokens,
            root=root,
            session_id=session_id,
        )
        miss = self.attribution.lookup(
            root,
            hashes,
            match.num_blocks,
            block_tokens,
            len(hashes) * block_tokens,
            session=(session_id, tenant) if session_id is not None else None,
        )
        return LookupResult(block_tokens, list(hashes), match, miss)

    def chain_prefix(self, root: bytes, hashes: Sequence[BlockHash]) -> int:
        """How many of ``hashes``, from the first, may match for a caller whose chain starts
        at ``root``: block 0 is a held chain root under ``root`` and each next id is the held
        child of the one before it. A block's root and parent never change (its id is their
        digest), so linkage to the caller's block 0 proves the whole run is the caller's.

        Cheap for the lookups clients make (a held run followed by blocks not held): two
        record reads, a binary search for the end of the held run (a lock round each), and one
        ``chain_to`` walk under the store lock compared with the ids. Only a run with a hole
        or a foreign id reads the records one by one, up to the first that does not fit."""
        store = self.store
        if not hashes:
            return 0
        first = store.meta(hashes[0])
        if first is None or first.parent is not None or first.namespace_root != root:
            return 0
        lo, hi = 1, len(hashes)
        while lo < hi:  # the last held block, assuming the held blocks are a prefix
            mid = (lo + hi + 1) // 2
            if store.contains(hashes[mid - 1]):
                lo = mid
            else:
                hi = mid - 1
        # chain_to walks the whole held ancestry of the block: only for one of the caller's
        # own chains (not a deep foreign one named after block 0), and then compared
        last = store.meta(hashes[lo - 1]) if lo > 1 else first
        if (
            last is not None
            and last.namespace_root == root
            and store.chain_to(hashes[lo - 1]) == list(hashes[:lo])
        ):
            return lo
        for i in range(1, lo):  # a hole in the held run, or ids that are no chain
            meta = store.meta(hashes[i])
            # the match ends at the first block not held: no need to look further
            if meta is None or meta.parent != hashes[i - 1] or not meta.tiers:
                return i
        return lo

    def _match(
        self,
        tenant: str,
        hashes: Sequence[BlockHash],
        *,
        session_id: str | None,
        lease_s: float | None,
    ) -> Match:
        if session_id is not None:
            return self.sessions.lookup(session_id, hashes, tenant=tenant, lease_s=lease_s)
        return self.store.lookup(hashes, lease_s=lease_s)

    def _count_tokens(
        self, hit: int, asked: int, *, root: bytes, session_id: str | None = None
    ) -> None:
        with self._lock:
            self._tokens.hit += hit
            self._tokens.miss += asked - hit
            per_root = self._root_tokens.get(root)
            if per_root is None:
                if len(self._root_tokens) >= MAX_TRACKED:
                    self._root_tokens.clear()  # a flood of namespaces: start counting afresh
                per_root = self._root_tokens[root] = TokenCounts()
            per_root.hit += hit
            per_root.miss += asked - hit
            if session_id is not None and hit:
                if session_id not in self._session_hits and len(self._session_hits) >= MAX_TRACKED:
                    self._session_hits.clear()
                self._session_hits[session_id] = self._session_hits.get(session_id, 0) + hit
        if self._usage is not None:  # durable history, bucketed (write-behind, never blocks)
            self._usage.record_usage("hit_tokens", hit)
            self._usage.record_usage("miss_tokens", asked - hit)

    def plan_store(
        self,
        tenant: str,
        namespace: Namespace,
        token_bytes: bytes,
        *,
        session_id: str | None = None,
        ttl_s: float | None = None,
    ) -> StorePlan:
        """Phase one of a store: every id of the prompt, and upload slots for the missing."""
        if ttl_s is not None and not ttl_s > 0:
            raise InvalidInput(f"ttl_s must be positive, got {ttl_s}")
        hashes = self.hashes(tenant, namespace, token_bytes)
        root = self.namespace_root(tenant, namespace)
        if session_id is not None:
            session = self.sessions.get(session_id, tenant=tenant)
            ttl_s = max(ttl_s or 0.0, session.ttl_s)
        match = self.store.lookup(hashes, ttl_s=ttl_s)
        # The match is a prefix; past it, blocks may still be held beyond a hole: one pass
        # under the store's lock instead of a lock round per block.
        start = match.num_blocks
        missing: list[BlockHash] = []
        for i, held in enumerate(self.store.contains_many(hashes[start:]), start):
            if held:
                continue
            missing.append(hashes[i])
            self.uploads.open(
                tenant,
                hashes[i],
                namespace_root=root,
                parent=hashes[i - 1] if i else None,
                ttl_s=ttl_s,
                session_id=session_id,
            )
        if session_id is not None and hashes:
            self.sessions.record(session_id, hashes, tenant=tenant)
            self.attribution.stored(session_id, tenant, hashes, bytes(token_bytes))
        return StorePlan(namespace.block_tokens, hashes, missing)

    def upload(self, tenant: str, block_hash: BlockHash, payload: Payload) -> bool:
        """Phase two: store one handed-out block; with ``durable_uploads`` (and a durable tier)
        it is on disk when this returns. Returns False when it was already held."""
        slot = self.uploads.peek(tenant, block_hash)
        if slot is None:
            raise UploadRefused(
                f"block {block_hash.hex()} was not handed out to this caller by POST /v1/store "
                "(or its upload slot expired)"
            )
        if slot.used and self._same_as_held(block_hash, payload):
            return False  # a retry whose first answer was lost
        result = self.store.put(
            [block_hash],
            [payload],
            namespace_root=slot.namespace_root,
            parent=slot.parent,
            ttl_s=slot.ttl_s,
            durable=self.durable_uploads,
        )
        self.uploads.mark_used(tenant, block_hash)
        if slot.session_id is not None and result.stored:
            self.sessions.adopt(slot.session_id, result.stored)
        return bool(result.stored)

    def _same_as_held(self, block_hash: BlockHash, payload: Payload) -> bool:
        """Whether the store holds ``block_hash`` with exactly ``payload``; raises
        ``UploadRefused`` when it holds other bytes. False when it no longer holds it (the
        retry stores it again)."""
        try:
            held = self.store.get_bytes(block_hash, promote=False)
        except BlockNotFound:
            return False
        if memoryview(held) != as_memoryview(payload):
            raise UploadRefused(
                f"block {block_hash.hex()} is already stored with other bytes; a repeated "
                "upload must carry the same payload"
            )
        return True

    def owns(self, tenant: str, block_hash: BlockHash) -> bool:
        return self.owned_meta(tenant, block_hash) is not None

    def owned_meta(self, tenant: str, block_hash: BlockHash) -> BlockMeta | None:
        """A snapshot of the block's record when ``tenant`` may read the block, else None
        (not held, or under another tenant's namespace root)."""
        meta = self.store.meta(block_hash)
        if meta is None:
            return None
        owner = self._owners.owner(meta.namespace_root)
        if owner == tenant or (owner is None and not self.auth_enabled):
            return meta
        return None

    def read_bytes(self, tenant: str, block_hash: BlockHash) -> bytes:
        """A copy of a block's payload, for the tenant owning its namespace only."""
        if not self.owns(tenant, block_hash):
            raise BlockNotFound(f"block {block_hash.hex()} is not held")
        return self.store.get_bytes(block_hash)

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
        for check in self._checks:
            problem = check.problem()
            if problem:
                problems.append(problem)
        return problems

    def locations(self, hashes: Sequence[BlockHash]) -> list[dict[str, list[str]]] | None:
        """For each id, which nodes of the fleet hold it and in which tiers (None without a
        fleet index)."""
        if self.fleet is None:
            return None
        return self.fleet.locations(hashes)

    def release(self, lease_id: str) -> None:
        """End a lease the caller has already checked is its own (the data plane's)."""
        self.store.release(lease_id)

    def release_for(self, tenant: str, lease_id: str) -> None:
        """End ``tenant``'s lease; another tenant's is ``LeaseNotFound`` like an unknown one,
        so that a lease id (which travels in logs and traces) gives no handle on the blocks of
        another tenant and a probe learns nothing from the answer. A lease pins one matched
        prefix, all under one namespace root: its first block says whose it is."""
        hashes = self.store.lease_hashes(lease_id)
        if hashes is None or (hashes and not self.owns(tenant, hashes[0])):
            raise LeaseNotFound(f"no live lease {lease_id!r}")
        self.store.release(lease_id)

    def close(self) -> None:
        if self.history is not None:
            self.history.stop()
        for hook in self._on_close:
            try:
                hook()
            except Exception:
                log.exception("error while closing")
        self.store.close()
