"""Prometheus metrics: store figures read at scrape time, request latency per route.

Two registries: the node-wide series, served to anyone, and those naming tenants, models and
engines (``tenant_metrics``), served only with the metrics or admin token (``scrape``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sessioncache.api.admin.auth import AdminAuth
from sessioncache.api.deps import bearer_key, source_address
from sessioncache.api.tenant_metrics import (
    EngineCollector,
    NamespaceCollector,
    TenantCollector,
    WriteBehindCollector,
)
from sessioncache.errors import AuthRefused
from sessioncache.node import CacheNode
from sessioncache.routing.scoring import Router
from sessioncache.store import TieredStore
from sessioncache.tiers.base import CheckedTier

CARRIERS = ("rest", "stream", "same_host")
"""The carriers of block payloads (``sessioncache_received_payload_bytes``)."""


class StoreCollector(Collector):
    """Reads the node's store counters and tier figures at every scrape (exact, no drift):
    node-wide figures only, no tenant's or model's name."""

    def __init__(self, node: CacheNode, store: TieredStore) -> None:
        self._node = node
        self._store = store

    def collect(self) -> Iterator[Any]:
        node, store = self._node, self._store
        counters = store.counters()
        tokens = node.token_counts()
        hit = CounterMetricFamily("sessioncache_hit_tokens", "Prompt tokens found in the cache")
        hit.add_metric([], tokens.hit)
        yield hit
        miss = CounterMetricFamily("sessioncache_miss_tokens", "Prompt tokens not found")
        miss.add_metric([], tokens.miss)
        yield miss
        saved = CounterMetricFamily(
            "sessioncache_prefill_seconds_saved",
            "Estimated engine prefill seconds saved: hit tokens / prefill tokens per second",
        )
        saved.add_metric([], tokens.hit / node.settings.prefill_tokens_per_s)
        yield saved
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
            "puts",
            "loaded_bytes",
            "evictions",
            "demotions",
            "demotions_refused",
            "promotions",
            "expirations",
            "stored_blocks",
            "dropped_blocks",
            "corrupt_reads",
        ):
            family = CounterMetricFamily(f"sessioncache_{name}", f"Store {name.replace('_', ' ')}")
            family.add_metric([], getattr(counters, name))
            yield family
        received = CounterMetricFamily(
            "sessioncache_received_payload_bytes",
            "Block payload bytes received from engines, by carrier",
            labels=["carrier"],
        )
        got = node.received.snapshot()
        for carrier in CARRIERS:
            received.add_metric([carrier], got.get(carrier, 0))
        yield received
        used = GaugeMetricFamily("sessioncache_tier_used_bytes", "Bytes held", labels=["tier"])
        cap = GaugeMetricFamily("sessioncache_tier_capacity_bytes", "Capacity", labels=["tier"])
        room = GaugeMetricFamily(
            "sessioncache_tier_room_bytes", "What it could hold now", labels=["tier"]
        )
        pinned = GaugeMetricFamily("sessioncache_tier_pinned_bytes", "Pinned", labels=["tier"])
        blocks = GaugeMetricFamily("sessioncache_tier_blocks", "Blocks held", labels=["tier"])
        for tier in store.stats_tiers():
            used.add_metric([tier.name], tier.used_bytes)
            cap.add_metric([tier.name], tier.capacity_bytes)
            room.add_metric([tier.name], tier.room_bytes)
            pinned.add_metric([tier.name], tier.pinned_bytes)
            blocks.add_metric([tier.name], tier.blocks)
        yield from (used, cap, room, pinned, blocks)
        sessions = GaugeMetricFamily("sessioncache_sessions", "Open sessions")
        sessions.add_metric([], node.sessions.count())
        yield sessions
        up = GaugeMetricFamily(
            "sessioncache_tier_up", "1 when the tier can serve (0: degraded)", labels=["tier"]
        )
        for t in store.tiers:
            up.add_metric([t.name], 0 if isinstance(t, CheckedTier) and t.problem() else 1)
        yield up
        degraded = GaugeMetricFamily(
            "sessioncache_degraded",
            "1 while a shared tier or the fleet index is unreachable, or the catalog unavailable",
        )
        degraded.add_metric([], 1 if node.health_problems() else 0)
        yield degraded
        catalog = GaugeMetricFamily(
            "sessioncache_catalog_up",
            "1 while the catalog takes writes (0: down, locked, read-only)",
        )
        catalog.add_metric([], 1 if node.dependencies()["catalog"] == "ok" else 0)
        yield catalog
        behind = store.write_behind
        if behind is not None:
            yield from _queue_metrics(
                ("write_behind_bound_bytes", "The write-behind queue's bound", behind.bound_bytes),
                ("written", behind.written, "Blocks the write-behind queue copied to disk"),
                ("failed", behind.failed, "Blocks the write-behind queue could not copy"),
            )
        republisher = store.republisher
        if republisher is not None:
            yield from _queue_metrics(
                ("shared_unpublished_blocks", "Missed by the shared tier", republisher.pending),
                ("published", republisher.published, "Published once the shared tier answered"),
                ("dropped", republisher.dropped, "Past a tenant's share: kept on this node"),
                prefix="shared_republish",
            )
        if node.fleet is not None:
            pending = GaugeMetricFamily("sessioncache_fleet_pending", "Queued fleet updates")
            pending.add_metric([], node.fleet.pending)
            yield pending
            if node.fleet.problem() is None:  # a scrape never waits on a Redis known down
                live = GaugeMetricFamily(
                    "sessioncache_fleet_nodes", "Live nodes in the fleet index (this one too)"
                )
                live.add_metric([], len(node.fleet.nodes()))
                yield live


def _queue_metrics(
    level: tuple[str, str, int], *counts: tuple[str, int, str], prefix: str = "write_behind"
) -> Iterator[Metric]:
    """A queue's gauge, then its counters (``sessioncache_<prefix>_<name>``)."""
    gauge = GaugeMetricFamily(f"sessioncache_{level[0]}", level[1])
    gauge.add_metric([], level[2])
    yield gauge
    for name, value, what in counts:
        family = CounterMetricFamily(f"sessioncache_{prefix}_{name}", what)
        family.add_metric([], value)
        yield family


LOOKUP_ROUTES = ("/v1/lookup",)


class Collectable(Protocol):
    def collect(self) -> Iterable[Metric]: ...


def latency_quantiles(
    source: Collectable,
    quantiles: Sequence[float] = (0.5, 0.95, 0.99),
    routes: Sequence[str] = LOOKUP_ROUTES,
) -> tuple[int, list[float | None]]:
    """(count, quantiles in seconds) of the request latency of ``routes`` since the start,
    from ``sessioncache_request_seconds``'s buckets with linear interpolation inside a
    bucket, as PromQL's ``histogram_quantile`` does (None: no request yet). ``source``: the
    histogram itself, not the registry, whose other collectors read the whole store."""
    buckets: dict[float, float] = {}
    for family in source.collect():
        if family.name != "sessioncache_request_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.labels.get("route") in routes:
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
    edges = sorted(buckets)
    total = buckets.get(math.inf, 0.0)
    if not total:
        return 0, [None for _ in quantiles]
    out: list[float | None] = []
    for q in quantiles:
        rank = q * total
        lower, below = 0.0, 0.0
        for le in edges:
            if buckets[le] >= rank:
                if math.isinf(le):
                    out.append(lower)  # beyond the last finite bucket: its bound
                else:
                    inside = buckets[le] - below
                    share = (rank - below) / inside if inside else 1.0
                    out.append(lower + (le - lower) * share)
                break
            lower, below = le, buckets[le]
    return int(total), out


class Metrics:
    """The node's two registries (module docstring)."""

    def __init__(self, node: CacheNode, router: Router, histogram: Histogram) -> None:
        self.node_wide = CollectorRegistry()
        self.node_wide.register(StoreCollector(node, node.store))
        self.node_wide.register(histogram)
        self.detail = CollectorRegistry()
        top = node.settings.metrics_top_namespaces
        self.detail.register(NamespaceCollector(node, node.store, top))
        self.detail.register(WriteBehindCollector(node.store))
        self.detail.register(TenantCollector(node.quotas))
        self.detail.register(EngineCollector(router))

    def scrape(self, request: Request) -> bytes:
        """The Prometheus text ``request`` may read: the node-wide series, and the detail
        too when ``reads_detail``."""
        text = generate_latest(self.node_wide)
        return text + generate_latest(self.detail) if reads_detail(request) else text


def reads_detail(request: Request) -> bool:
    """Whether a scrape may read the series naming tenants and models: on a node running open
    (no API keys, on loopback: every local caller is its admin) any may; else one carrying the
    metrics or admin token as its bearer key. Without a key, or with a tenant's, only the
    node-wide series; any other key is refused (401, or 429 from an address locked for its
    wrong tokens)."""
    auth: AdminAuth = request.app.state.admin_auth
    node: CacheNode = request.app.state.node
    key = bearer_key(request)
    if auth.mode == "open":
        return True
    if key is None or (node.auth_enabled and node.tenant_for_key(key) is not None):
        return False
    address = source_address(request)
    if auth.metrics_token_matches(key, address):
        return True
    wrong = AuthRefused(
        "wrong token: /metrics takes the metrics token (SESSIONCACHE_METRICS_TOKEN) or the "
        "admin token as its bearer key, or none for the node-wide series"
    )
    raise auth.refusal(address, wrong)


def install(app: FastAPI, node: CacheNode, router: Router) -> Metrics:
    """Time every request (``LatencyMiddleware``) and gather the node's series."""
    latency = Histogram(
        "sessioncache_request_seconds",
        "Request latency by route",
        ["method", "route", "status"],
        registry=None,
        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
    )
    app.add_middleware(LatencyMiddleware, histogram=latency)
    app.state.request_latency = latency  # the dashboard's lookup latency percentiles
    return Metrics(node, router, latency)


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
