"""Lookup latency percentiles read from the request histogram, as histogram_quantile does."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from sessioncache.api.metrics import latency_quantiles


def histogram() -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry()
    h = Histogram(
        "sessioncache_request_seconds",
        "latency",
        ["method", "route", "status"],
        registry=registry,
        buckets=(0.001, 0.01, 0.1),
    )
    return registry, h


def test_no_lookups_yet():
    _, h = histogram()
    h.labels("GET", "/v1/stats", "200").observe(0.5)  # not a lookup
    assert latency_quantiles(h) == (0, [None, None, None])


def test_interpolated_within_buckets():
    _, h = histogram()
    for _ in range(50):
        h.labels("POST", "/v1/lookup", "200").observe(0.0005)  # bucket (0, 1 ms]
    for _ in range(50):
        h.labels("POST", "/v1/lookup", "422").observe(0.005)  # (1, 10 ms], other status
    count, (p50, p95, p99) = latency_quantiles(h)
    assert count == 100
    assert p50 == pytest.approx(0.001)
    assert p95 == pytest.approx(0.001 + 0.009 * 0.9)
    assert p99 == pytest.approx(0.001 + 0.009 * 0.98)


def test_beyond_the_last_bucket_is_its_bound():
    registry, h = histogram()
    h.labels("POST", "/v1/lookup", "200").observe(5.0)
    assert latency_quantiles(h, (0.5,)) == (1, [0.1])
    assert latency_quantiles(registry, (0.5,)) == (1, [0.1])  # a registry works too
