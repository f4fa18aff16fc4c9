"""The dashboard's in-memory history: bounded, rates from consecutive samples."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from sessioncache.history import Sample, StatsHistory, rates


def sample(at: float, **kw: int) -> Sample:
    base = dict.fromkeys(
        (
            "hit_tokens",
            "miss_tokens",
            "lookups",
            "puts",
            "stored_blocks",
            "loaded_bytes",
            "evictions",
            "demotions",
            "expirations",
            "corrupt_reads",
            "sessions",
        ),
        0,
    )
    return Sample(at=at, tiers=(), **{**base, **kw})  # type: ignore[arg-type]


def test_rates_between_two_samples():
    a = sample(100.0, hit_tokens=10, miss_tokens=10, lookups=5, loaded_bytes=1000, evictions=1)
    b = replace(a, at=110.0, hit_tokens=40, miss_tokens=20, lookups=25, loaded_bytes=6000)
    r = rates(a, b)
    assert r.lookups_per_s == 2.0 and r.load_bytes_per_s == 500.0
    assert r.hit_rate == 0.75 and r.evictions_per_min == 0.0
    assert rates(a, a).hit_rate is None and rates(a, a).lookups_per_s == 0.0


def test_the_ring_keeps_the_span_only():
    counter = iter(range(1000))

    def source() -> Sample:
        n = next(counter)
        return sample(float(n), lookups=n)

    history = StatsHistory(source, interval_s=5, span_s=20)
    for _ in range(10):
        history.sample()
    kept = history.samples()
    assert [s.at for s in kept] == [5.0, 6.0, 7.0, 8.0, 9.0]
    assert [s.at for s in history.samples(since=7.0)] == [8.0, 9.0]
    recent = history.recent_rates(window_s=2.5)  # a fresh sample at 10 against 8
    assert recent is not None and recent.seconds == 2.0 and recent.lookups_per_s == 1.0


def test_the_loop_samples_in_the_background():
    clock = [0.0]

    def source() -> Sample:
        clock[0] += 1
        return sample(clock[0])

    history = StatsHistory(source, interval_s=0.01, span_s=1)
    history.start()
    try:
        deadline = time.monotonic() + 5
        while len(history.samples()) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        history.stop()
    assert len(history.samples()) >= 3


def test_bad_periods():
    with pytest.raises(ValueError):
        StatsHistory(lambda: sample(0.0), interval_s=0)
    with pytest.raises(ValueError):
        StatsHistory(lambda: sample(0.0), interval_s=10, span_s=5)
