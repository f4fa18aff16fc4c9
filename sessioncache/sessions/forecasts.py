"""Each open session's forecast, and the forecasts it files on the store's blocks.

``SessionManager`` tells this room what a session did (a request arrived or finished, its
prompt left the previous one's chain, it closed), with the chains concerned; this room keeps
the session's ``Rhythm`` and files the chain under the forecast that follows
(``StoreReads.forecast``: ``sessioncache.store.forecast`` has the model). Under plain LRU (no
``Forecast``) it keeps nothing and files nothing.

Called with the manager's lock held (it calls the store: the lock order is sessions, then
store); ``next_use``, called without it, takes it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from sessioncache.clock import Clock
from sessioncache.hashing import BlockHash, divergence_block
from sessioncache.store.forecast import Forecast, Rhythm

SessionKey = tuple[str, str]
FURTHEST_OF = 64
"""How many of the least recently active pinned sessions the pin budget compares."""


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
    ) -> None:
        self._reads = reads
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
            return rhythm.key_if(finish, self.forecast, now)

    def current(self, key: SessionKey) -> tuple[float, str | None] | None:
        """When the session is expected back (``Rhythm.expected_back``) and its latest finish
        class; None under plain LRU or before its first request here."""
        rhythm = self._rhythms.get(key)
        if self.forecast is None or rhythm is None:
            return None
        return rhythm.expected_back(self.forecast, self._clock.now()), rhythm.finish

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
        if shared:
            chain = chain[common_prefix(chain, shared) :]
        now = self._clock.now()
        rhythm = self._rhythm(key)
        if finish is None:
            rhythm.arrive(now)
        else:
            rhythm.finished_with(finish, now)
        self._reads.forecast(chain, rhythm.key(self.forecast, now))

    def refile(self, key: SessionKey, chain: Sequence[BlockHash]) -> None:
        """Blocks of the session's chain that arrived since (uploaded one by one): its
        current forecast."""
        rhythm = self._rhythms.get(key)
        if self.forecast is not None and rhythm is not None:
            self._reads.forecast(chain, rhythm.key(self.forecast, self._clock.now()))

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
        return self.forecast.value(
            rhythm.key(self.forecast, now), now if last is None else last, now
        )

    def forget(self, key: SessionKey) -> None:
        self._rhythms.pop(key, None)

    def _rhythm(self, key: SessionKey) -> Rhythm:
        rhythm = self._rhythms.get(key)
        if rhythm is None:
            rhythm = self._rhythms[key] = Rhythm()
        return rhythm


def common_prefix(a: Sequence[BlockHash], b: Sequence[BlockHash]) -> int:
    """How many leading ids ``a`` and ``b`` share (``hashing.divergence_block``)."""
    at = divergence_block(a, b"".join(b))
    return min(len(a), len(b)) if at is None else at
