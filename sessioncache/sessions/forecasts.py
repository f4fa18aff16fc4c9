"""Each open session's forecast, and the forecasts it files on the store's blocks.

``SessionManager`` tells this room what a session did (a request arrived or finished, its
prompt left the previous one's chain, it closed), with the chains concerned; this room keeps
the session's ``Rhythm`` and files the chain under the forecast that follows
(``StoreReads.forecast``: ``sessioncache.store.forecast`` has the model). Under plain LRU (no
``Forecast``) it keeps nothing and files nothing.

A session's hints (``hints.HintState``: a priority, an expected return, priorities of parts
of its chain, ``final``) steer the key its chain is filed under (``steered``): an expected
return is the date of its next use, a priority scales how far ahead that lies (``scale``), a
final session's chain is dead.

Called with the manager's lock held (it calls the store: the lock order is sessions, then
store); ``next_use``, called without it, takes it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from sessioncache.clock import Clock
from sessioncache.hashing import BlockHash, divergence_block
from sessioncache.sessions.hints import NEUTRAL, HintState
from sessioncache.store.forecast import (
    BACK_SIGMA,
    MIN_GAP_S,
    ORPHAN_BASE,
    POOLED,
    Forecast,
    Gap,
    Rhythm,
)

SessionKey = tuple[str, str]
FURTHEST_OF = 64
"""How many of the least recently active pinned sessions the pin budget compares."""
PRIORITY_STEP = 12.5
"""A priority this much above ``NEUTRAL`` halves how far ahead its session's next use lies
(100: a sixteenth; 0: sixteen times as far)."""


class ForecastReads(Protocol):
    """What of the store's reads this room uses."""

    def forecast(
        self, hashes: Sequence[BlockHash], next_use: float | None, *, past_forks: bool = False
    ) -> int: ...


class SessionForecasts:
    """Rhythms of the open sessions, and their filing (module docstring)."""

    def __init__(
        self,
        reads: ForecastReads,
        forecast: Forecast | None,
        clock: Clock,
        lock: AbstractContextManager[object],
        hinted: Callable[[SessionKey], HintState | None] = lambda key: None,
    ) -> None:
        """``hinted``: a session's hints, if it has any (the manager's)."""
        self._reads = reads
        self._hinted = hinted
        self.forecast = forecast
        self._clock = clock
        self._lock = lock  # the manager's: ``next_use`` takes it, the rest run under it
        self._rhythms: dict[SessionKey, Rhythm] = {}

    def opened(self, key: SessionKey, parent: SessionKey | None) -> None:
        """The session opened, forked from ``parent`` (a subagent's) when given."""
        if self.forecast is not None and parent is not None and parent != key:
            self._rhythm(key).parent = parent

    def parent(self, key: SessionKey) -> SessionKey | None:
        rhythm = self._rhythms.get(key)
        return rhythm.parent if rhythm is not None else None

    def next_use(self, key: SessionKey, finish: str | None = None) -> float | None:
        """The eviction key (``forecast``: minus the cold date) of the blocks a store on the
        session's behalf makes, were its request arriving now (``finish`` None) or finishing
        now for that class. None under plain LRU."""
        if self.forecast is None:
            return None
        with self._lock:
            now = self._clock.now()
            rhythm = self._rhythms.get(key) or Rhythm()
            return self.steered(key, rhythm.key_if(finish, self.forecast, now), now, now)

    def current(self, key: SessionKey) -> tuple[float, str | None] | None:
        """When the session is expected back (``Rhythm.expected_back``) and its latest finish
        class; None under plain LRU or before its first request here."""
        rhythm = self._rhythms.get(key)
        hint = self._hinted(key)
        now = self._clock.now()
        back = hint.expected_at(now) if hint is not None else None
        if self.forecast is None or (rhythm is None and back is None):
            return None
        if back is None:
            assert rhythm is not None
            back = rhythm.expected_back(self.forecast, now)
        return back, rhythm.finish if rhythm is not None else None

    def back_after(self, key: SessionKey, seconds: float) -> bool:
        """Whether the session is expected back (``current``) only more than ``seconds`` from
        now; False under plain LRU or before its first request here."""
        current = self.current(key)
        return current is not None and current[0] > self._clock.now() + seconds

    def seen(
        self,
        key: SessionKey,
        finish: str | None,
        chain: Sequence[BlockHash],
        shared: Sequence[BlockHash] = (),
    ) -> None:
        """A request of the session arrived (``finish`` None) or finished for that class;
        ``chain`` (its held prefix counts) is filed under the forecast that follows, but for
        the prefix it shares with ``shared`` (a subagent's parent's chain, whose forecast it
        keeps)."""
        if self.forecast is None:
            return
        now = self._clock.now()
        rhythm = self._rhythm(key)
        if finish is None:
            rhythm.arrive(now)
            hint = self._hinted(key)
            if hint is not None:
                hint.arrived()
        else:
            rhythm.finished_with(finish, now)
        self._file(key, rhythm, chain, now, common_prefix(chain, shared) if shared else 0)

    def refile(self, key: SessionKey, chain: Sequence[BlockHash]) -> None:
        """Blocks of the session's chain that arrived since (uploaded one by one): its
        current forecast."""
        rhythm = self._rhythms.get(key)
        if self.forecast is not None and rhythm is not None:
            self._reads.forecast(chain, self._key(key, rhythm, self._clock.now()))

    def hinted(
        self, key: SessionKey, chain: Sequence[BlockHash], shared: Sequence[BlockHash] = ()
    ) -> None:
        """The session's hints changed: its chain (``chain``, the whole of it) is filed
        again under what they say, but for the prefix it shares with ``shared`` (its
        parent's chain)."""
        if self.forecast is None:
            return
        skip = common_prefix(chain, shared) if shared else 0
        self._file(key, self._rhythm(key), chain, self._clock.now(), skip)

    def steered(self, key: SessionKey, k: float, origin: float, now: float) -> float:
        """The key ``k`` (of an event at ``origin``) as the session's hints have it: an
        expected return dates its next use, its priority scales how far ahead that lies, a
        final session's chain is dead."""
        hint = self._hinted(key)
        if hint is None or self.forecast is None:
            return k
        if hint.final:
            return ORPHAN_BASE - origin
        back = hint.expected_at(now)
        if back is not None:
            k = self._dated(back, now)
            origin = now
        return k if hint.priority is None else scale(self.forecast, k, origin, hint.priority)

    def _dated(self, back: float, now: float) -> float:
        """The key of a chain whose session is expected back at ``back``."""
        assert self.forecast is not None
        if self.forecast.mode == "next_use":
            return back
        if self.forecast.mode == "chance":
            return self.forecast.dated_key(back, now)
        gap = Gap(0.999, math.log(max(MIN_GAP_S, back - now)), BACK_SIGMA)
        return self.forecast.cold_key(gap, now)

    def _key(self, key: SessionKey, rhythm: Rhythm, now: float) -> float:
        assert self.forecast is not None
        return self.steered(key, rhythm.key(self.forecast, now), _origin(rhythm, now), now)

    def _file(
        self,
        key: SessionKey,
        rhythm: Rhythm,
        chain: Sequence[BlockHash],
        now: float,
        skip: int,
    ) -> None:
        """File ``chain`` (but its first ``skip`` blocks: its parent's) under the session's
        key, and the parts of it a hint ranks under their own priority."""
        assert self.forecast is not None
        self._reads.forecast(chain[skip:], self._key(key, rhythm, now))
        hint = self._hinted(key)
        if hint is None or not hint.spans or hint.final:
            return
        origin = _origin(rhythm, now)
        back = hint.expected_at(now)
        base = rhythm.key(self.forecast, now) if back is None else self._dated(back, now)
        origin = origin if back is None else now
        for span in hint.spans:
            part = chain[max(skip, span.start) : span.end]
            if part:
                self._reads.forecast(part, scale(self.forecast, base, origin, span.priority))

    def left(self, old: Sequence[BlockHash], chain: Sequence[BlockHash]) -> None:
        """The session's prompt is now ``chain``, which left ``old``: the blocks of ``old``
        past the fork are reached by no live chain of the session."""
        if self.forecast is None:
            return
        dead = self.forecast.dead_branch_s
        self._reads.forecast(
            old[common_prefix(old, chain) :],
            None if dead is None else self.forecast.dead_branch_key(self._clock.now()),
            past_forks=True,
        )

    def closed(
        self, key: SessionKey, chain: Sequence[BlockHash], parent_chain: Sequence[BlockHash]
    ) -> None:
        """The session closed: ``chain`` has no forecast any more, but for the prefix it
        shares with its parent's ``parent_chain``."""
        if self.forecast is not None:
            self._reads.forecast(chain[common_prefix(chain, parent_chain) :], None)

    def furthest(self, keys: Iterable[SessionKey]) -> SessionKey:
        """Of ``keys`` (least recently active first), the session whose chain goes cold first
        (the smallest cold date: ``forecast``), among the first ``FURTHEST_OF`` (a bounded
        cost per unpin); the first under LRU."""
        order = iter(keys)
        first = next(order)
        if self.forecast is None:
            return first
        now = self._clock.now()
        best, top = first, self._value(first, now)
        for key in itertools.islice(order, FURTHEST_OF - 1):
            value = self._value(key, now)
            if value > top:
                best, top = key, value
        return best

    def _value(self, key: SessionKey, now: float) -> float:
        rhythm = self._rhythms.get(key)
        if rhythm is None or self.forecast is None:
            return -math.inf
        last = rhythm.finished if rhythm.finished is not None else rhythm.arrived
        return self.forecast.value(self._key(key, rhythm, now), now if last is None else last, now)

    def forget(self, key: SessionKey) -> None:
        self._rhythms.pop(key, None)

    def _rhythm(self, key: SessionKey) -> Rhythm:
        rhythm = self._rhythms.get(key)
        if rhythm is None:
            rhythm = self._rhythms[key] = Rhythm()
        return rhythm


def scale(forecast: Forecast, k: float, origin: float, priority: int) -> float:
    """The key ``k`` of an event at ``origin`` for a priority (``NEUTRAL``: ``k``): the lead
    of the next use (``next_use`` mode) or of the cold date (``value``) over ``origin``
    shrinks by half for each ``PRIORITY_STEP`` above neutral and doubles for each below. A
    dead chain (no return expected) stays dead, but in the ``next_use`` mode ranked above
    neutral, where it is valued as an average session's next return."""
    if priority == NEUTRAL:
        return k
    factor = math.pow(2.0, (NEUTRAL - priority) / PRIORITY_STEP)
    if forecast.mode == "chance":  # dated: the class's median return, so scaled
        if k >= ORPHAN_BASE / 2:  # dead
            if priority <= NEUTRAL:
                return k
            lead = forecast.ahead(forecast.priors[POOLED])
        else:  # the class's median return, or the date a hint gave
            c, event = forecast.event_of(k)
            if c < len(forecast.classes):
                event += forecast.class_gap(c).median()
            lead = max(0.0, event - origin)
        return forecast.dated_key(origin + lead * factor, origin)
    if forecast.mode == "next_use":
        if k >= ORPHAN_BASE / 2:  # dead
            if priority <= NEUTRAL:
                return k
            k = origin + forecast.ahead(forecast.priors[POOLED])
        return origin + (k - origin) * factor
    if k >= ORPHAN_BASE / 2:  # dead, in either mode
        return k
    cold = -k  # value mode: the key is minus the cold date, later for a higher priority
    lead = cold - origin
    return -(origin + (lead / factor if lead > 0 else lead * factor))


def _origin(rhythm: Rhythm, now: float) -> float:
    """When the session's last event was (``now`` before any)."""
    if rhythm.finish is not None and rhythm.finished is not None:
        return rhythm.finished
    return rhythm.arrived if rhythm.arrived is not None else now


def common_prefix(a: Sequence[BlockHash], b: Sequence[BlockHash]) -> int:
    """How many leading ids ``a`` and ``b`` share (``hashing.divergence_block``)."""
    at = divergence_block(a, b"".join(b))
    return min(len(a), len(b)) if at is None else at
