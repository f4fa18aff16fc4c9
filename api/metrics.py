"""Prometheus metrics: store figures read at scrape time, request latency per route."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sessioncache.node import CacheNode
from sessioncache.tiers.base import CheckedTier


class StoreCollector(Collector):
    """Reads the node's store counters and tier figures at every scrape (exact, no drift)."""

    def __init__(self, node: CacheNode) -> None:
        self._node = node

    def collect(self) -> Iterator[Any]:
        node = self._node
        counters = node.store.counters()
        tokens = node.token_counts()
        hit = CounterMetricFamily("sessioncache_hit_tokens", "Prompt tokens found in the cache")
        hit.add_metric([], tokens.hit)
        yield hit
        miss = CounterMetricFamily("sessioncache_miss_tokens", "Prompt tokens not found")
        miss.add_metric([], tokens.miss)
        yield miss
        by_reason = CounterMetricFamily(
            "sessioncache_miss_tokens_by_reason",
            "Prompt tokens not found, by why (docs/prompt-stability.md)",
            labels=["reason"],
        )
        for reason, count in node.attribution.miss_tokens().items():
            by_reason.add_metric([reason], count)
        yield by_reason
        for name in (
            "lookups",
            "evictions",
            "demotions",
            "promotions",
            "expirations",
            "stored_blocks",
            "dropped_blocks",
            "corrupt_reads",
        ):
            family = CounterMetricFamily(f"sessioncache_{name}", f"Store {name.replace('_', ' ')}")
            family.add_metric([], getattr(counters, name))
            yield family
        used = GaugeMetricFamily("sessioncache_tier_used_bytes", "Bytes held", labels=["tier"])
        cap = GaugeMetricFamily("sessioncache_tier_capacity_bytes", "Capacity", labels=["tier"])
        pinned = GaugeMetricFamily("sessioncache_tier_pinned_bytes", "Pinned", labels=["tier"])
        blocks = GaugeMetricFamily("sessioncache_tier_blocks", "Blocks held", labels=["tier"])
        for tier in node.store.stats_tiers():
            used.add_metric([tier.name], tier.used_bytes)
            cap.add_metric([tier.name], tier.capacity_bytes)
            pinned.add_metric([tier.name], tier.pinned_bytes)
            blocks.add_metric([tier.name], tier.blocks)
        yield from (used, cap, pinned, blocks)
        sessions = GaugeMetricFamily("sessioncache_sessions", "Open sessions")
        sessions.add_metric([], node.sessions.count())
        yield sessions
        up = GaugeMetricFamily(
            "sessioncache_tier_up", "1 when the tier can serve (0: degraded)", labels=["tier"]
        )
        for t in node.store.tiers:
            up.add_metric([t.name], 0 if isinstance(t, CheckedTier) and t.problem() else 1)
        yield up
        degraded = GaugeMetricFamily(
            "sessioncache_degraded", "1 while a shared tier or the fleet index is unreachable"
        )
        degraded.add_metric([], 1 if node.health_problems() else 0)
        yield degraded
        if node.fleet is not None:
            pending = GaugeMetricFamily("sessioncache_fleet_pending", "Queued fleet updates")
            pending.add_metric([], node.fleet.pending)
            yield pending


def install(app: FastAPI, node: CacheNode) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(StoreCollector(node))
    latency = Histogram(
        "sessioncache_request_seconds",
        "Request latency by route",
        ["method", "route", "status"],
        registry=registry,
        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
    )

    app.add_middleware(LatencyMiddleware, histogram=latency)

    return registry


class LatencyMiddleware:
    """Request latency per route template, as plain ASGI: Starlette's ``BaseHTTPMiddleware``
    re-streams every body through extra tasks, which cost block uploads most of their speed."""

    def __init__(self, app: ASGIApp, histogram: Histogram) -> None:
        self._app = app
        self._histogram = histogram

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            self._histogram.labels(scope["method"], path, str(status[0])).observe(
                time.perf_counter() - start
            )
