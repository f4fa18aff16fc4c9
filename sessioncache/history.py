"""A short in-memory history of a node's counters, so the dashboard's charts have a past
when the page opens (by default the last hour at 5 s: 720 samples).

``StatsHistory(source, interval_s, span_s)`` keeps the ``Sample``s ``source()`` returns, one
per ``interval_s`` once ``start()``ed (a ``BackgroundLoop``), oldest dropped past ``span_s``.
Samples hold cumulative counters and current gauges; rates are differences of consecutive
samples (``rates``), so a missed tick only widens one interval, it loses nothing. Nothing is
persisted: the catalog's ``usage`` table is the durable, coarse history.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sessioncache.background import BackgroundLoop


@dataclass(frozen=True, slots=True)
class TierSample:
    name: str
    used_bytes: int
    capacity_bytes: int
    pinned_bytes: int
    blocks: int


@dataclass(frozen=True, slots=True)
class Sample:
    """A node's figures at one instant: counters (cumulative since start) and gauges."""

    at: float
    hit_tokens: int
    miss_tokens: int
    lookups: int
    puts: int
    stored_blocks: int
    loaded_bytes: int
    evictions: int
    demotions: int
    expirations: int
    corrupt_reads: int
    sessions: int
    tiers: tuple[TierSample, ...]


@dataclass(frozen=True, slots=True)
class Rates:
    """Per-second rates between two samples (zero over an empty interval)."""

    seconds: float
    lookups_per_s: float
    stores_per_s: float
    load_bytes_per_s: float
    hit_rate: float | None
    """Hit tokens / looked-up tokens over the interval; None when nothing was looked up."""
    evictions_per_min: float
    demotions_per_min: float
    expirations_per_min: float


def rates(old: Sample, new: Sample) -> Rates:
    dt = new.at - old.at
    per_s = 1.0 / dt if dt > 0 else 0.0
    hit = new.hit_tokens - old.hit_tokens
    asked = hit + new.miss_tokens - old.miss_tokens
    return Rates(
        seconds=dt,
        lookups_per_s=(new.lookups - old.lookups) * per_s,
        stores_per_s=(new.puts - old.puts) * per_s,
        load_bytes_per_s=(new.loaded_bytes - old.loaded_bytes) * per_s,
        hit_rate=hit / asked if asked > 0 else None,
        evictions_per_min=(new.evictions - old.evictions) * per_s * 60,
        demotions_per_min=(new.demotions - old.demotions) * per_s * 60,
        expirations_per_min=(new.expirations - old.expirations) * per_s * 60,
    )


class StatsHistory:
    """A bounded ring of ``Sample``s taken every ``interval_s`` (see the module docstring)."""

    def __init__(
        self, source: Callable[[], Sample], *, interval_s: float = 5.0, span_s: float = 3600.0
    ) -> None:
        if not interval_s > 0 or not span_s >= interval_s:
            raise ValueError("history: interval_s must be positive and span_s at least that")
        self._source = source
        self.interval_s = interval_s
        self._samples: deque[Sample] = deque(maxlen=int(span_s // interval_s) + 1)
        self._lock = threading.Lock()
        self._loop = BackgroundLoop("stats-history", self.sample, interval_s)

    def sample(self) -> Sample:
        """Take a sample now and keep it."""
        sample = self._source()
        with self._lock:
            self._samples.append(sample)
        return sample

    def samples(self, since: float | None = None) -> list[Sample]:
        """The kept samples, oldest first (only those taken after ``since``)."""
        with self._lock:
            kept: Sequence[Sample] = list(self._samples)
        return [s for s in kept if since is None or s.at > since]

    def recent_rates(self, window_s: float = 60.0) -> Rates | None:
        """Rates from a fresh sample back to the oldest kept one within ``window_s`` (the
        last minute by default), without keeping the fresh one; None before any sample."""
        now = self._source()
        with self._lock:
            older = [s for s in self._samples if s.at >= now.at - window_s and s.at < now.at]
            if not older and self._samples:
                older = [self._samples[-1]]
        return rates(older[0], now) if older else None

    def start(self) -> None:
        self.sample()  # a first point at once: the first rates need two
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()
