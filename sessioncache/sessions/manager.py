"""Agent sessions: sliding TTLs and chain pins over the store.

A session is one agent conversation: it comes back after seconds, hours or days with the same
prefix plus a little more. Each lookup or store that names a session

* extends the session's expiry (``expires_at = now + ttl``: a sliding TTL; defaults: agent
  3 days, chat 7 days, configurable per kind),
* raises the TTL of every block it touches to at least the session's, so blocks shared by
  several sessions (system prompt, tool schemas) live as long as the longest-lived of them,
* moves the session's head to the last block of its chain and pins that chain while the
  session is live, so capacity pressure cannot evict it.

Each also feeds the session's forecast (``sessioncache.store.forecast``): when it is expected back,
from its requests' arrivals, their finish reasons where the engine or agent passes them
(``finish_reason`` on a store or on ``record``), its own rhythm, its close and its parent
session (a subagent's). The chain it touched is filed under that forecast, which is what the
default eviction order reads; blocks of a previous prompt the new one no longer reaches, and a
closed session's chain, get none and leave first. This is soft state: a restart forgets it
and the session starts again from the defaults.

A session's pin is admitted against its tenant's share of each tier (``budget``,
``quotas.PinBudget``): it pins the prefix of the chain that fits with what the tenant pins
already. Pins are released by ``close``, by an idle timeout (the session stays open; its
blocks then age out by TTL, and its next request pins again), when a request finishes and the
session's forecast has it back only after that timeout (``pins_follow_forecast``: a finished
turn whose user reads for minutes; its chain then competes by that forecast, as unpinned
blocks do), and by the pin budget: pinned
bytes per tier are bounded by a share of the tier's capacity, past which pins go, those of
the tenant pinning the largest share of the tier first, and of its sessions those expected
back last (under LRU, the least recently active) first: a tenant's finish reasons order its
own sessions, never another's. Unpinned blocks fall back to ordinary eviction priority, so
pins can never make the cache refuse work.
``sweep`` (run by a background thread in the service, or ``sessioncache gc`` by hand) expires
sessions and blocks.

A session's agent hints (``hint``; ``sessioncache.sessions.hints`` maps the field's formats
onto one ``Hint``) steer it: a soft TTL holds its pins that long past its last activity instead
of the idle timeout (at most ``max_hint_ttl_s`` and the session's own TTL; still admitted
against the tenant's pin share and broken by the pin budget, so it never refuses work); a
priority, an expected return and ranked parts of its chain change the key its chain is filed
under (``SessionForecasts.steered``); ``final`` and ``discard`` unpin it now, and a final
session's requests pin nothing until a hint says otherwise; ``evict`` edits unpin it and file
those blocks to leave first; a parent makes it a subagent of that session. Hints are soft
state too.

Thread-safe. The manager's lock guards the sessions and their pins, and is never held across
a store call that may wait on I/O: a lookup that misses locally asks the fleet's shared tier
(a network round trip), a record touches its chain. Such a call runs between two short holds of the
lock (``_begin``, ``_end``): the first checks the session and copies its TTL, the second
records the activity only if the same session is still open, so a session closed, swept or
replaced meanwhile gains no pins (nothing would ever release them) and is not written back.
The request then counts as having happened just before the close. Pins and unpins (``pin``,
``unpin``: index bookkeeping, no I/O) stay under the lock, so ``_pins`` is always exactly what
the store holds for each session. The lock order is sessions, then store.
"""

from __future__ import annotations

import functools
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from sessioncache.errors import InvalidInput, SessionNotFound
from sessioncache.hashing import BlockHash
from sessioncache.quotas import Counts, PinBudget
from sessioncache.sessions.forecasts import SessionForecasts, common_prefix
from sessioncache.sessions.hints import Hint, HintStates
from sessioncache.sessions.query import SessionPage, SessionQuery, SessionSearch, page_in_memory
from sessioncache.store import Match, TieredStore, TierStats
from sessioncache.store.expiry import ExpiryIndex
from sessioncache.store.forecast import finish_class
from sessioncache.store.results import MAX_TTL_S, check_ttl

DAY_S = 86400.0
DEFAULT_KIND_TTLS: Mapping[str, float] = {"agent": 3 * DAY_S, "chat": 7 * DAY_S}
DEFAULT_IDLE_TIMEOUT_S = 300.0
DEFAULT_PIN_SHARE = 0.5
DEFAULT_MAX_HINT_TTL_S = 3600.0
SESSION_ID_PATTERN = r"^[^/\s\u0000-\u001f\u007f-\u009f]+$"
"""What a session id may hold, as the API's JSON schema states it (ECMA and Python regexes
read it alike): no '/', no whitespace, no control character."""
_SESSION_ID = re.compile(SESSION_ID_PATTERN)

MAX_SESSION_ID_LEN = 128
DEFAULT_TENANT = "default"

SessionKey = tuple[str, str]
"""A session's identity: (tenant, id). Ids are scoped by tenant: two tenants' sessions of one
id are two sessions, and nothing one does with it shows in the other's."""


@dataclass(slots=True)
class Session:
    id: str
    tenant: str
    kind: str
    ttl_s: float
    created: float
    last_seen: float
    expires_at: float
    head: BlockHash | None = None
    pinned: bool = False

    @property
    def key(self) -> SessionKey:
        return (self.tenant, self.id)


@dataclass(frozen=True, slots=True)
class SweepReport:
    expired_sessions: int
    idle_unpinned: int
    expired_blocks: int


class SessionRepository(Protocol):
    """Where sessions outlive the process (the catalog implements it).

    ``create_session`` and ``delete_session`` are durable when they return: an acknowledged
    open or close survives a crash. ``save_session`` (the sliding TTL and head of every
    request) may be written behind, so a crash loses at most its last batch.
    """

    def create_session(self, session: Session) -> None: ...

    def save_session(self, session: Session) -> None: ...

    def delete_session(self, key: SessionKey) -> None: ...

    def load_sessions(self) -> Iterable[Session]: ...

    def load_session(self, key: SessionKey) -> Session | None: ...


class SessionManager:
    """Sessions over a ``TieredStore`` (see the module docstring)."""

    def __init__(
        self,
        store: TieredStore,
        *,
        kind_ttls: Mapping[str, float] = DEFAULT_KIND_TTLS,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        pin_share: float = DEFAULT_PIN_SHARE,
        repository: SessionRepository | None = None,
        admit: Callable[[str, int], None] | None = None,
        budget: Callable[[str], PinBudget | None] | None = None,
        pinned_of: Callable[[str], Sequence[int]] | None = None,
        max_hint_ttl_s: float = DEFAULT_MAX_HINT_TTL_S,
        pins_follow_forecast: bool = False,
    ) -> None:
        """``admit``, ``budget`` and ``pinned_of``: the tenants' bounds (``quotas``), each
        described where it is kept below; left out, that bound does not apply.
        ``max_hint_ttl_s``: the longest soft TTL a hint gives. ``pins_follow_forecast``:
        a finish whose forecast return lies past ``idle_timeout_s`` releases the session's
        pins at once (unless a hint's soft TTL holds them); no effect without a forecast."""
        for kind, ttl in kind_ttls.items():
            if not 0 < ttl <= MAX_TTL_S:
                raise InvalidInput(f"the TTL of session kind {kind!r} must be positive")
        if not idle_timeout_s > 0:
            raise InvalidInput("idle_timeout_s must be positive")
        if not 0 <= pin_share <= 1:
            raise InvalidInput("pin_share must be within [0, 1]")
        if not 0 < max_hint_ttl_s <= MAX_TTL_S:
            raise InvalidInput("max_hint_ttl_s must be positive")
        self._store = store
        self._clock = store.clock
        self._kind_ttls = dict(kind_ttls)
        self._idle_timeout = idle_timeout_s
        self._pin_share = pin_share
        self._pins_follow = pins_follow_forecast
        self._repo = repository
        self._lock = threading.RLock()
        self._sessions: dict[SessionKey, Session] = {}
        self.tenants = Counts()
        """Open sessions per tenant."""
        self.admit = admit
        """Admits one more open session to a tenant holding so many (``Quotas.admitter`` of
        ``sessions``; None: no bound)."""
        self.budget: Callable[[str], PinBudget | None] = budget or (lambda tenant: None)
        """What a tenant's session pins are admitted against (None: only the pin budget)."""
        self.pinned_of = pinned_of
        """The bytes a tenant pins per tier, which the pin budget unpins the most of first
        (None: the sessions of every tenant are one pool)."""
        # Pinned sessions, least recently active first, with the ids their pins hold.
        self._pins: OrderedDict[SessionKey, list[BlockHash]] = OrderedDict()
        # When sessions expire, and when pinned ones go idle: a sweep visits the due ones only.
        self._expiring: ExpiryIndex[SessionKey] = ExpiryIndex()
        self._idling: ExpiryIndex[SessionKey] = ExpiryIndex()
        self._unpin_listeners: list[Callable[[SessionKey, str], None]] = []
        self.hints = HintStates(max_hint_ttl_s, self._lock)
        """Each open session's agent hints as they stand (soft state: not in the repository)."""
        self.forecasts = SessionForecasts(
            store.reads, store.forecast, self._clock, self._lock, self.hints.get
        )
        """Each open session's forecast (soft state: not in the repository)."""

    @property
    def store(self) -> TieredStore:
        """The store holding its sessions' chains (a session's blocks are stored there by the
        operation layer, ``operations.stores``, which then ``record``s the chain)."""
        return self._store

    def on_unpin(self, listener: Callable[[SessionKey, str], None]) -> None:
        """Call ``listener((tenant, session_id), cause)`` when a session's pins go: ``pin_budget``,
        ``idle``, ``closed`` or ``expired`` (miss attribution tells capacity pressure from the
        pin budget's). Called with the manager's lock held: it must not call back."""
        self._unpin_listeners.append(listener)

    # -- lifecycle ----------------------------------------------------------------------

    def open(
        self,
        session_id: str | None = None,
        *,
        tenant: str = DEFAULT_TENANT,
        kind: str = "agent",
        ttl_s: float | None = None,
        parent: str | None = None,
    ) -> Session:
        """Open a session, or return the tenant's open one with that id. ``parent``: the
        session it was forked from (a subagent's), of the same tenant: its close spares the
        prefix they share."""
        if kind not in self._kind_ttls:
            raise InvalidInput(
                f"unknown session kind {kind!r}; kinds are {sorted(self._kind_ttls)}"
            )
        if ttl_s is not None:
            check_ttl(ttl_s)
        if session_id is not None:
            _check_id(session_id)
        if parent is not None:
            _check_id(parent)
        with self._lock:
            now = self._clock.now()
            if session_id is not None and self._find((tenant, session_id)) is not None:
                session = self._owned(session_id, tenant)
                session.last_seen = now
                session.expires_at = max(session.expires_at, now + session.ttl_s)
                self._save(session)
                return replace(session)
            if self.admit is not None:
                self.admit(tenant, self.tenants.get(tenant))
            ttl = self._kind_ttls[kind] if ttl_s is None else float(ttl_s)
            session = Session(
                id=session_id or secrets.token_hex(16),
                tenant=tenant,
                kind=kind,
                ttl_s=ttl,
                created=now,
                last_seen=now,
                expires_at=now + ttl,
            )
            if self._repo is not None:  # first: a session the catalog refuses is not opened
                self._repo.create_session(replace(session))
            self._held(session)
            self.forecasts.opened(session.key, (tenant, parent) if parent is not None else None)
            return replace(session)

    def get(self, session_id: str, *, tenant: str = DEFAULT_TENANT) -> Session:
        with self._lock:
            return replace(self._owned(session_id, tenant))

    def count(self) -> int:
        with self._lock:
            return len(self._sessions)

    def list_sessions(self, *, tenant: str | None = None) -> list[Session]:
        with self._lock:
            return [
                replace(s) for s in self._sessions.values() if tenant is None or s.tenant == tenant
            ]

    def page(self, query: SessionQuery) -> SessionPage:
        """One page of the open sessions, searched and sorted: in SQL when the repository
        pages itself (the catalog, which also holds the fleet's other nodes' sessions), else
        over the sessions in memory. ``pinned`` is this node's view."""
        now = self._clock.now()
        if isinstance(self._repo, SessionSearch):
            page = self._repo.query_sessions(query, now=now)
            with self._lock:
                for session in page.sessions:
                    session.pinned = session.key in self._pins
            return page
        with self._lock:
            return page_in_memory([replace(s) for s in self._sessions.values()], query, now=now)

    def extend(
        self, session_id: str, *, tenant: str = DEFAULT_TENANT, ttl_s: float | None = None
    ) -> Session:
        """Slide the session's expiry (optionally with a new, longer or shorter, TTL)."""
        if ttl_s is not None:
            check_ttl(ttl_s)
        with self._lock:
            session = self._owned(session_id, tenant)
            now = self._clock.now()
            if ttl_s is not None:
                session.ttl_s = float(ttl_s)
            session.last_seen = now
            session.expires_at = now + session.ttl_s
            self._expiring.add(session.key, session.expires_at)  # may be sooner than filed
            self._save(session)
            return replace(session)

    def close(self, session_id: str, *, tenant: str = DEFAULT_TENANT) -> None:
        """End the session: its pins go; its blocks age out by their TTL."""
        with self._lock:
            self._drop(self._owned(session_id, tenant).key, "closed")

    def hint(self, session_id: str, hint: Hint, *, tenant: str = DEFAULT_TENANT) -> Session:
        """Take an agent hint for the tenant's open session (module docstring). A prefetch it
        asks for is the caller's to start (the operation layer)."""
        if hint.parent is not None:
            _check_id(hint.parent)
        with self._lock:
            session = self._owned(session_id, tenant)
            key = session.key
            now = self._clock.now()
            state = self.hints.apply(key, hint, now, session.ttl_s)
            if hint.parent is not None:
                self.forecasts.opened(key, (tenant, hint.parent))
            chain = _chain(self._pins, self._store, session)
            if key in self._pins and (state.final or hint.discard or hint.evict):
                self._unpin(key, "hint")
            elif key in self._pins and hint.ttl_s is not None:
                self._idling.add(
                    key, self.hints.idle_due(session.key, session.last_seen, self._idle_timeout)
                )
            parent = self.forecasts.parent(key)
            shared = _chain(self._pins, self._store, self._sessions.get(parent)) if parent else ()
            self.forecasts.hinted(key, chain, shared)
            for span in hint.evict:
                part = chain[span.start : span.end]
                if shared:
                    part = part[max(0, common_prefix(chain, shared) - span.start) :]
                self._store.reads.forecast(part, None)
            return replace(session)

    # -- data path ----------------------------------------------------------------------

    def lookup(
        self,
        session_id: str,
        hashes: Sequence[BlockHash],
        *,
        tenant: str = DEFAULT_TENANT,
        lease_s: float | None = None,
        budget: PinBudget | None = None,
        counted: bool = True,
    ) -> Match:
        """``reads.lookup`` on behalf of a session: TTLs at least the session's, chain pinned;
        ``budget``: its lease's, ``counted``: whether the store counts it (``reads.lookup``)."""
        session, ttl = self._begin(session_id, tenant)
        match = self._store.reads.lookup(
            hashes, lease_s=lease_s, ttl_s=ttl, budget=budget, counted=counted
        )
        self._end(session, match.hashes)
        return match

    def record(
        self,
        session_id: str,
        chain: Sequence[BlockHash] = (),
        *,
        tenant: str = DEFAULT_TENANT,
        finish_reason: str | None = None,
    ) -> Session:
        """Note that the session's chain is now ``chain`` (blocks stored some other way, for
        instance PUT one by one over HTTP): slide its TTL, raise its blocks' TTLs, pin them.
        ``finish_reason`` (``tool_use``, ``stop``, ...: ``forecast.FINISH_CLASSES``): the
        session's latest request finished so, and its chain (``chain``, or with none the
        session's) is filed under the forecast that follows."""
        finish = finish_class(finish_reason) if finish_reason is not None else None
        session, ttl = self._begin(session_id, tenant)
        if chain:
            self._store.reads.touch(chain, ttl_s=ttl)  # activity, not a lookup
        with self._lock:
            self._end(session, chain, finish)
            return replace(session)

    def adopt(self, key: SessionKey, hashes: Sequence[BlockHash]) -> None:
        """Blocks of a pinned session's chain that arrived after its last request (uploaded
        one by one): pin them too."""
        with self._lock:
            held = self._pins.get(key)
            if held is None:
                return
            pinned = self._store.reads.pin(hashes, self.budget(key[0]))
            held.extend(pinned)
            self.forecasts.refile(key, pinned)
            self._enforce_pin_budget()

    # -- maintenance --------------------------------------------------------------------

    def sweep(self) -> SweepReport:
        """Expire sessions past their TTL, unpin idle ones, then expire blocks."""
        with self._lock:
            now = self._clock.now()
            expired = self._expiring.due(now, self._due)
            for key in expired:
                self._drop(key, "expired")
            idle = self._idling.due(now, functools.partial(self._due, idle=True))
            for key in idle:
                self._unpin(key, "idle")
        return SweepReport(len(expired), len(idle), self._store.writes.expire())

    def restore(self) -> int:
        """Load sessions from the repository (after a restart) and pin the live ones' chains,
        walking each head's parents in the store. Returns how many sessions were loaded."""
        if self._repo is None:
            return 0
        with self._lock:
            now = self._clock.now()
            loaded = 0
            for session in self._repo.load_sessions():
                if session.expires_at <= now:
                    self._repo.delete_session(session.key)
                    continue
                session.pinned = False
                self._held(session)
                loaded += 1
                if session.head is not None and session.last_seen + self._idle_timeout > now:
                    chain = self._store.reads.chain_to(session.head)
                    if chain:
                        self._pin(session, chain)
            self._enforce_pin_budget()
            return loaded

    def pinned_sessions(self) -> list[SessionKey]:
        """Sessions whose chains are pinned, least recently active first."""
        with self._lock:
            return list(self._pins)

    # -- a store call between two holds of the lock (see the module docstring) -----------

    def _begin(self, session_id: str, tenant: str) -> tuple[Session, float]:
        """The open session (``SessionNotFound`` otherwise) and its TTL, for the store call."""
        with self._lock:
            session = self._owned(session_id, tenant)
            return session, session.ttl_s

    def _end(self, session: Session, chain: Sequence[BlockHash], finish: str | None = None) -> None:
        """After the store call: ``chain`` is the session's activity (empty: none held), if
        the session is still the open one of its id; ``finish``: the class of its request's
        finish, if this is it (else a request has arrived)."""
        with self._lock:
            if self._sessions.get(session.key) is not session:
                return  # closed, swept or replaced meanwhile: this came just before that
            if chain:
                self._activity(session, chain)
            else:
                self._slide(session)
            if not chain:  # a finish files the session's chain; an arrival what it pins
                pinned = self._pins.get(session.key) or ()
                chain = pinned if finish is None else _chain(self._pins, self._store, session)
            parent = self.forecasts.parent(session.key)  # a subagent spares its parent's
            shared = _chain(self._pins, self._store, self._sessions.get(parent)) if parent else ()
            self.forecasts.seen(session.key, finish, chain, shared)
            if finish is not None and self._pins_follow and session.key in self._pins:
                hint = self.hints.get(session.key)  # a soft TTL holds them
                if (hint is None or hint.ttl_s is None) and self.forecasts.back_after(
                    session.key, self._idle_timeout
                ):
                    self._unpin(session.key, "idle")  # back only after they would go idle

    # -- internals (lock held) ----------------------------------------------------------

    def _find(self, key: SessionKey) -> Session | None:
        session = self._sessions.get(key)
        if session is None and self._repo is not None:
            # Opened through another node sharing the catalog: it continues here.
            session = self._repo.load_session(key)
            if session is not None and session.expires_at > self._clock.now():
                session.pinned = False
                self._held(session)
        return session

    def _held(self, session: Session) -> None:
        """``session`` is open here from now on."""
        self._sessions[session.key] = session
        self._expiring.add(session.key, session.expires_at)
        self.tenants.add(session.tenant)

    def _drop(self, key: SessionKey, cause: str) -> None:
        """The session ends (``closed``, ``expired``): pins, row and count go; a closed
        session's chain has no forecast any more, but for what its parent shares."""
        if cause == "closed" and self.forecasts.forecast is not None:
            parent = self.forecasts.parent(key)
            self.forecasts.closed(
                key,
                _chain(self._pins, self._store, self._sessions.get(key)),
                _chain(self._pins, self._store, self._sessions.get(parent) if parent else None),
            )
        self.forecasts.forget(key)
        self.hints.forget(key)
        self._unpin(key, cause)
        self.tenants.add(self._sessions.pop(key).tenant, -1)
        if self._repo is not None:
            self._repo.delete_session(key)

    def _due(
        self, key: SessionKey, now: float, *, idle: bool = False
    ) -> tuple[SessionKey | None, float | None]:
        """For ``ExpiryIndex.due``: the key if the session has expired (``idle``: if its pins
        have gone idle), else when to look again (never once it is gone, or, for ``idle``,
        unpinned: a new pin files it again)."""
        session = self._sessions.get(key)
        if session is None or (idle and key not in self._pins):
            return None, None
        due = (
            self.hints.idle_due(key, session.last_seen, self._idle_timeout)
            if idle
            else session.expires_at
        )
        return (key, None) if due <= now else (None, due)

    def _owned(self, session_id: str, tenant: str) -> Session:
        _check_id(session_id)  # before any catalog read: an id from the data plane is raw
        session = self._find((tenant, session_id))
        if session is None:
            raise SessionNotFound(f"no open session {session_id!r}")
        if session.expires_at <= self._clock.now():
            raise SessionNotFound(f"session {session_id!r} has expired")
        return session

    def _slide(self, session: Session) -> None:
        now = self._clock.now()
        session.last_seen = now
        session.expires_at = max(session.expires_at, now + session.ttl_s)
        if session.key in self._pins:
            self._pins.move_to_end(session.key)
        self._save(session)

    def _activity(self, session: Session, chain: Sequence[BlockHash]) -> None:
        head = session.head
        if self.forecasts.forecast is not None and head is not None and head not in chain:
            # the prompt left the previous one's chain
            self.forecasts.left(_chain(self._pins, self._store, session), chain)
        session.head = chain[-1]
        hint = self.hints.get(session.key)
        if hint is None or not hint.final:  # a final session pins nothing
            self._pin(session, chain)
        self._slide(session)
        self._enforce_pin_budget()

    def _pin(self, session: Session, chain: Sequence[BlockHash]) -> None:
        old = self._pins.pop(session.key, None)
        if old and len(chain) >= len(old) and chain[len(old) - 1] == old[-1]:
            # The usual turn: the chain only grew. Ids commit to their whole prefix, so equal
            # last ids mean the old pins are a prefix of the new chain: pin the growth only.
            if len(chain) > len(old):
                old.extend(self._store.reads.pin(chain[len(old) :], self.budget(session.tenant)))
            new = old
        else:
            # Pin the new chain before unpinning the old: shared blocks never drop to zero.
            new = self._store.reads.pin(chain, self.budget(session.tenant))
            if old:
                self._store.reads.unpin(old)
        self._pins[session.key] = new
        if old is None:
            self._idling.add(
                session.key, self.hints.idle_due(session.key, session.last_seen, self._idle_timeout)
            )
        session.pinned = True

    def _unpin(self, key: SessionKey, cause: str) -> None:
        for listener in self._unpin_listeners:
            listener(key, cause)
        held = self._pins.pop(key, None)
        if held:
            self._store.reads.unpin(held)
        session = self._sessions.get(key)
        if session is not None:
            session.pinned = False

    def _enforce_pin_budget(self) -> None:
        while self._pins:
            tiers = self._store.stats_tiers()
            over = [
                i
                for i, t in enumerate(tiers)
                if t.pinned_bytes > self._pin_share * t.capacity_bytes
            ]
            if not over:
                return
            tenant = most_pinning(self._pins, self.pinned_of, tiers, over)
            # its session expected back last (under LRU: the least recently active)
            keys = self._pins if tenant is None else (k for k in self._pins if k[0] == tenant)
            self._unpin(self.forecasts.furthest(keys), "pin_budget")

    def _save(self, session: Session) -> None:
        if self._repo is not None:
            self._repo.save_session(replace(session))


def most_pinning(
    pins: Iterable[SessionKey],
    pinned_of: Callable[[str], Sequence[int]] | None,
    tiers: Sequence[TierStats],
    over: Sequence[int],
) -> str | None:
    """Of the tenants with pinned sessions (``pins``), the one furthest over its fair share of
    the tiers ``over`` the pin budget: every tenant's fair share is the same, so the one
    pinning the largest share of one of them (``pinned_of``: per tier; None: one pool)."""
    tenants = {tenant for tenant, _ in pins}
    if pinned_of is None or len(tenants) < 2:
        return None

    def share(tenant: str) -> float:
        pinned = pinned_of(tenant)
        return max(
            (pinned[i] / tiers[i].capacity_bytes for i in over if tiers[i].capacity_bytes),
            default=0.0,
        )

    return max(sorted(tenants), key=share)


def _chain(
    pins: Mapping[SessionKey, list[BlockHash]], store: TieredStore, session: Session | None
) -> Sequence[BlockHash]:
    """A session's chain: what it pins, else what is held up to its head."""
    if session is None:
        return ()
    pinned = pins.get(session.key)
    if pinned:
        return pinned
    return store.reads.chain_to(session.head) if session.head is not None else ()


def _check_id(session_id: str) -> None:
    if (
        not isinstance(session_id, str)
        or not 0 < len(session_id) <= MAX_SESSION_ID_LEN
        or _SESSION_ID.fullmatch(session_id) is None
    ):
        raise InvalidInput(
            f"a session id is 1 to {MAX_SESSION_ID_LEN} characters, none of them '/', "
            "whitespace or a control character"
        )
