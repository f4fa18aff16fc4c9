"""Prefetch: a session's chain moved up into the CPU tier before the session comes back.

A long pause sends a session's chain down to disk (or the fleet's Redis), and its next turn's
first load then runs at that tier's speed. The node moves the chain back up ahead of the read,
two ways, through one engine (``Prefetcher``) and one mover (``store.prefetch``):

* **Explicit** (``request``): an engine, router or agent says the session is coming back
  (``POST /v1/sessions/{id}/prefetch``, the stream's operation). The answer comes at once:
  ``accepted`` (the move is queued; ``blocks``: how many are to move), ``deferred`` (the
  queue is full, or the CPU tier has no room this prefetch may take: retry later) or
  ``rejected`` (the tenant's CPU share admits not one block, the session has no chain, the
  node has no CPU tier). An accepted prefetch holds a lease on the chain (``hold_s``), so
  that it stays in the CPU tier until the session's lookup.
* **From the forecast** (``tick``, every second on a node): the one return forecast
  (``sessions.forecasts``, ``store.forecast``) values each session's chain by its predicted
  next use (the eviction value of its head block). A chain not in the CPU tier is promoted,
  soonest first, once the CPU tier has free room or holds blocks forecast back after it;
  ``lead`` (the chain's bytes at the disk's measured speed) moves its turn earlier. Its
  lease lasts only while it moves (so that no block of the chain is a victim of its own
  move): the chain then stays by the eviction order, which ranks it by the same value.
  On by default; ``prefetch_forecast=false`` turns it off.

A prefetch is a grant: its lease is admitted against the tenant's share of the tiers
(``quotas.PinBudget``, with the chain counted in the CPU tier), as a lookup's lease is, so a
tenant's prefetches are refused only by its own share. A move evicts from the CPU tier only
expired blocks, spare copies and blocks forecast back later than the chain (any unpinned
block of the tenant's own, for an explicit prefetch): pinned and leased blocks never leave,
and no tenant's prefetch takes the place of another's sooner return.

The moves run on one worker thread (``start``), the tenants in turn, each with a bounded
queue (``tenant_queue``, ``total_queue``); without the thread (a replay, a test) ``drain``
runs what is queued. The measured speed is the worker's own copies, smoothed.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sessioncache.background import BackgroundLoop
from sessioncache.errors import QuotaExceeded
from sessioncache.hashing import BlockHash
from sessioncache.quotas import Counts, PinBudget
from sessioncache.sessions.manager import SessionKey, SessionManager
from sessioncache.store import TieredStore
from sessioncache.store.blocks import BlockMeta
from sessioncache.store.eviction import spare_copy
from sessioncache.store.fair import TenantTurns
from sessioncache.store.forecast import ORPHAN_BASE
from sessioncache.store.prefetch import Granted

log = logging.getLogger("sessioncache.prefetch")

ACCEPTED = "accepted"
DEFERRED = "deferred"
REJECTED = "rejected"

DEFAULT_HOLD_S = 300.0
DEFAULT_TENANT_QUEUE = 16
DEFAULT_TOTAL_QUEUE = 256
DEFAULT_DISK_BYTES_PER_S = float(1 << 30)
TICK_S = 1.0
TICK_SESSIONS = 8
"""Chains the forecast pass tries per tick, soonest first."""
MOVE_S = 60.0
"""The lease of a forecast move, let go when the move ends (a bound should it not)."""
RETRY_S = 60.0
"""A forecast move that could not be made is tried again once the store changed, or after
this long (the values move with the clock alone too)."""


@dataclass(frozen=True)
class PrefetchOutcome:
    """The answer to a prefetch request."""

    outcome: str
    """``accepted``, ``deferred`` or ``rejected``."""
    reason: str
    blocks: int
    """Blocks of the chain to move up (accepted), or that were asked for."""


class _Sum(Counts):
    """The bytes a tenant holds outside the index in the CPU tier: its same-host stagings
    (``staged``) and the room its queued moves will take (``reserved``)."""

    def __init__(self, staged: Counts | None, reserved: Counts) -> None:
        super().__init__()
        self._staged = staged
        self._reserved = reserved

    def get(self, tenant: str) -> int:
        held = self._reserved.get(tenant)
        return held + (self._staged.get(tenant) if self._staged is not None else 0)


@dataclass(slots=True)
class _Job:
    key: SessionKey
    chain: list[BlockHash]
    lease_id: str | None
    """The grant's lease (an explicit prefetch's, kept; a forecast move's, released)."""
    limit: float | None
    """Victims of other tenants must be forecast back after this (their eviction value);
    None: an explicit prefetch of a chain with no forecast, which takes none of theirs."""
    explicit: bool
    reserved: int = 0
    """Bytes of the tenant's CPU share its move holds until it ends (``Prefetcher.reserved``)."""


class Prefetcher:
    """The prefetch engine of one node (module docstring)."""

    def __init__(
        self,
        store: TieredStore,
        sessions: SessionManager,
        *,
        budget: Callable[[str], PinBudget | None],
        tenant_of: Callable[[bytes], str],
        forecast: bool = True,
        hold_s: float = DEFAULT_HOLD_S,
        tenant_queue: int = DEFAULT_TENANT_QUEUE,
        total_queue: int = DEFAULT_TOTAL_QUEUE,
        disk_bytes_per_s: float = DEFAULT_DISK_BYTES_PER_S,
        tick_s: float = TICK_S,
        returns: Callable[[SessionKey], float | None] | None = None,
    ) -> None:
        """``budget``: what a tenant's lasting pins are admitted against (``TenantPins``);
        ``tenant_of``: the tenant owning a namespace root; ``forecast``: the forecast pass
        on; ``returns``: a session's known next return (a replay's oracle) instead of its
        forecast."""
        self._store = store
        self._sessions = sessions
        self._budget = budget
        self._tenant_of = tenant_of
        self.forecast_enabled = forecast
        self._hold_s = hold_s
        self.bytes_per_s = disk_bytes_per_s
        """The disk's speed as the moves measure it (bytes per second, smoothed)."""
        self._returns = returns
        self._tick_s = tick_s
        names = store.tier_names()
        self.target: int | None = (
            names.index("cpu")
            if "cpu" in names
            else (0 if len(names) > 1 and not store.tiers[0].durable else None)
        )
        """The tier chains move into: the CPU tier (None: the node has none)."""
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queues: TenantTurns[_Job] = TenantTurns(tenant_queue, total_queue)
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop = BackgroundLoop("prefetch-forecast", self.tick, tick_s)
        self.moved_blocks = 0
        self.moved_bytes = 0
        self.forecast_moves = 0
        self.reserved = Counts()
        """Per tenant, the CPU bytes its queued and running moves will take: counted in its
        share (as staged bytes) from the grant until the move ends."""
        self._pending: set[SessionKey] = set()
        """Sessions with a move queued or running."""
        self._lengths: dict[SessionKey, int] = {}
        self._futile: dict[SessionKey, tuple[BlockHash, tuple[int, ...], float]] = {}
        """Sessions whose forecast move could not be made: their head, the store's version
        and the time then (``RETRY_S``)."""
        """The chain length each session had at its last forecast move (its lead)."""

    # -- the two requests ---------------------------------------------------------------

    def request(self, key: SessionKey) -> PrefetchOutcome:
        """An explicit prefetch of the session's chain (module docstring); ``SessionNotFound``
        for a session that is not open."""
        tenant, session_id = key
        session = self._sessions.get(session_id, tenant=tenant)
        target = self.target
        if target is None:
            return PrefetchOutcome(REJECTED, "this node has no CPU tier", 0)
        chain = self._store.reads.chain_to(session.head) if session.head is not None else []
        if not chain:
            return PrefetchOutcome(REJECTED, "the session holds no chain", 0)
        moves = self._store.prefetch
        _, below, _ = moves.below(chain, target)
        if not below:
            return PrefetchOutcome(ACCEPTED, "resident: the chain is in the CPU tier", 0)
        with self._lock:
            if key in self._pending:
                return PrefetchOutcome(ACCEPTED, "queued already", below)
            if self._queues.full(tenant):
                return PrefetchOutcome(DEFERRED, "the prefetch queue is full: retry later", below)
        limit = self._value_of(chain[-1], self._store.clock.now())
        if not self._room(tenant, limit, explicit=True, need=below):
            return PrefetchOutcome(
                DEFERRED,
                "no room now: no block of the CPU tier may leave for this chain (pinned, "
                "still being written to disk, or forecast back sooner): retry later",
                below,
            )
        budget = self._budget(tenant)
        if budget is None:
            return PrefetchOutcome(REJECTED, "no budget for this tenant", below)
        try:
            granted = self._grant(chain, self._hold_s, budget)
        except QuotaExceeded as exc:
            return PrefetchOutcome(REJECTED, f"pin_share: {exc}", below)
        if granted is None:
            return PrefetchOutcome(REJECTED, "the session holds no chain", 0)
        job = _Job(key, chain[: granted.blocks], granted.lease.id, limit, True, granted.below_bytes)
        if not self._queue(job):
            return PrefetchOutcome(DEFERRED, "the prefetch queue is full: retry later", below)
        cut = granted.blocks < len(chain)
        reason = (
            f"pin_share: the first {granted.blocks} of {len(chain)} blocks fit the tenant's share"
            if cut
            else "queued"
        )
        return PrefetchOutcome(ACCEPTED, reason, granted.below)

    def resident(self, key: SessionKey) -> dict[str, int]:
        """Blocks of the session's chain per tier, each counted in the fastest tier holding
        it (every tier named); ``SessionNotFound`` for a session that is not open."""
        tenant, session_id = key
        session = self._sessions.get(session_id, tenant=tenant)
        chain = self._store.reads.chain_to(session.head) if session.head is not None else []
        return self._store.prefetch.resident(chain)

    # -- the forecast pass --------------------------------------------------------------

    def tick(self) -> int:
        """One pass of the forecast prefetch (module docstring): queue the moves of the
        chains due now; how many were queued."""
        target = self.target
        if not self.forecast_enabled or target is None:
            return 0
        if self._store.forecast is None and self._returns is None:
            return 0
        now = self._store.clock.now()
        worst = self._worst(target, now)
        due: list[tuple[float, float, SessionKey, BlockHash]] = []
        sessions = self._sessions.list_sessions()
        self._forget_closed({session.key for session in sessions})
        for session in sessions:
            head = session.head
            if head is None:
                continue
            meta = self._store.reads.meta(head)
            if meta is None or target in meta.tiers or not meta.tiers:
                continue  # its head is up: the chain is (tails leave first)
            if min(meta.tiers) < target:
                continue
            key = session.key
            if self._returns is not None:
                back = self._returns(key)
                if back is None or back > now + self._tick_s:
                    continue
                due.append((back, now, key, head))
                continue
            value = self._value(meta, now)
            if value >= ORPHAN_BASE / 2:
                continue  # forecast never back
            lead = meta.nbytes * self._lengths.get(key, 1) / self.bytes_per_s
            if value - lead < worst:
                due.append((value - lead, value, key, head))
        if not due:
            return 0
        due.sort()
        queued = 0
        version = self._store.prefetch.version(target)
        tried = 0
        for _, limit, key, head in due:
            futile = self._futile.get(key)
            if futile is not None and futile[:2] == (head, version) and now < futile[2] + RETRY_S:
                continue
            if tried == TICK_SESSIONS:
                break
            tried += 1
            self._futile[key] = (head, version, now)
            chain = self._store.reads.chain_to(head)
            self._lengths[key] = len(chain)
            budget = self._budget(key[0])
            if not chain or budget is None:
                continue
            with self._lock:
                if key in self._pending:
                    continue
            try:
                granted = self._grant(chain, MOVE_S, budget)
            except QuotaExceeded:
                continue
            if granted is None:
                continue
            job = _Job(
                key, chain[: granted.blocks], granted.lease.id, limit, False, granted.below_bytes
            )
            if not granted.below:
                self._end(job)
                continue
            queued += self._queue(job)
        self.forecast_moves += queued
        return queued

    def _forget_closed(self, open_keys: set[SessionKey]) -> None:
        """Drop what the forecast pass remembers of sessions no longer open."""
        for remembered in (self._lengths, self._futile):
            for key in [k for k in remembered if k not in open_keys]:
                del remembered[key]

    # -- the worker ---------------------------------------------------------------------

    def start(self) -> None:
        """The worker thread and the forecast pass's loop."""
        with self._lock:
            if self._thread is not None:
                return
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="prefetch", daemon=True)
            self._thread.start()
        if self.forecast_enabled:
            self._loop.start()

    def stop(self) -> None:
        self._loop.stop()
        with self._lock:
            self._stop = True
            self._work.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(10.0)
        with self._lock:
            jobs = self._queues.clear()
        for job in jobs:
            if job.lease_id is not None:
                self._store.prefetch.release(job.lease_id)
            self._end(job, release=False)

    def drain(self) -> int:
        """Run every queued move here (no worker thread); how many ran."""
        ran = 0
        while True:
            with self._lock:
                job = self._queues.pop()
            if job is None:
                return ran
            self._move(job)
            ran += 1

    @property
    def queued(self) -> int:
        with self._lock:
            return len(self._queues)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._queues:
                    self._work.wait()
                if self._stop:
                    return
                job = self._queues.pop()
            if job is not None:
                try:
                    self._move(job)
                except Exception:
                    log.exception("prefetch of session %r", job.key[1])

    def _move(self, job: _Job) -> None:
        target = self.target
        assert target is not None
        tenant = job.key[0]
        admits = self._admits(tenant, job.limit, explicit=job.explicit)
        started = time.perf_counter()
        try:
            moved = self._store.prefetch.promote(job.chain, admits, target)
        finally:
            self._end(job)
        elapsed = time.perf_counter() - started
        self.moved_blocks += moved.blocks
        self.moved_bytes += moved.nbytes
        if moved.nbytes >= 1 << 20 and elapsed > 0:
            self.bytes_per_s += 0.25 * (moved.nbytes / elapsed - self.bytes_per_s)

    def _grant(
        self, chain: Sequence[BlockHash], lease_s: float, budget: PinBudget
    ) -> Granted | None:
        """The lease of a move, admitted against ``budget`` with the room the tenant's other
        moves hold (``reserved``), and its own room reserved with it."""
        target = self.target
        assert target is not None
        if budget.staged_tier in (None, target):
            budget = budget._replace(staged=_Sum(budget.staged, self.reserved), staged_tier=target)
        return self._store.prefetch.lease(chain, lease_s, budget, target, self.reserved)

    def _queue(self, job: _Job) -> bool:
        """Queue ``job``; False (its grant ended) when the queues are full."""
        with self._lock:
            if not self._queues.full(job.key[0]) and job.key not in self._pending:
                self._pending.add(job.key)
                self._queues.push(job.key[0], job)
                self._work.notify()
                return True
        self._end(job, release=True)
        return False

    def _end(self, job: _Job, *, release: bool | None = None) -> None:
        """A move ended (or never ran): its reserved room goes back, and a forecast move's
        lease (an explicit one's with ``release``)."""
        if job.reserved:
            self.reserved.add(job.key[0], -job.reserved)
            job.reserved = 0
        if release is None:
            release = not job.explicit
        if release and job.lease_id is not None:
            self._store.prefetch.release(job.lease_id)
            job.lease_id = None
        with self._lock:
            self._pending.discard(job.key)

    # -- the rules ----------------------------------------------------------------------

    def _admits(
        self, tenant: str, limit: float | None, *, explicit: bool
    ) -> Callable[[BlockMeta, BlockMeta, int, float], bool]:
        """Who a move of ``tenant``'s chain may evict (called under the store's lock)."""
        tenant_of = self._tenant_of
        value = self._value

        def admits(victim: BlockMeta, incoming: BlockMeta, tier: int, now: float) -> bool:
            if victim.expired(now) or spare_copy(victim, tier):
                return True
            if explicit and tenant_of(victim.namespace_root) == tenant:
                return True  # its own unpinned blocks: its own call
            return limit is not None and value(victim, now) > limit

        return admits

    def _room(self, tenant: str, limit: float | None, *, explicit: bool, need: int) -> bool:
        """Whether a move could start now: free room in the CPU tier, or a first victim the
        move may take."""
        target = self.target
        assert target is not None
        moves = self._store.prefetch
        if moves.free_bytes(target) > 0:
            return True
        victim = moves.next_victim(target)
        if victim is None:
            return False
        now = self._store.clock.now()
        return self._admits(tenant, limit, explicit=explicit)(victim, victim, target, now)

    def _worst(self, target: int, now: float) -> float:
        """The eviction value of the CPU tier's next victim (inf: free room, or a victim that
        costs nothing)."""
        moves = self._store.prefetch
        if moves.free_bytes(target) > 0:
            return math.inf
        victim = moves.next_victim(target)
        if victim is None:
            return -math.inf  # all pinned
        if victim.expired(now) or spare_copy(victim, target):
            return math.inf
        return self._value(victim, now)

    def _value(self, meta: BlockMeta, now: float) -> float:
        """When a block is forecast back (the larger, the later), however far ahead: the
        eviction value before its cap (``Forecast.predicted``), so that chains returning past
        the cap still rank against one another."""
        forecast = self._store.forecast
        if forecast is None:
            return now + (now - meta.last_access)
        return forecast.predicted(meta.next_use, meta.last_access, now)

    def _value_of(self, head: BlockHash, now: float) -> float | None:
        meta = self._store.reads.meta(head)
        if meta is None or self._store.forecast is None:
            return None
        return self._value(meta, now)
