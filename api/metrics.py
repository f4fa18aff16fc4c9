"""Prometheus metrics: store figures read at scrape time, request latency per route."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sessioncache.codecs import stored_bytes
from sessioncache.node import CacheNode
from sessioncache.quotas import Quotas
from sessioncache.routing.scoring import Router
from sessioncache.store import TieredStore
from sessioncache.tiers.base import CheckedTier


class StoreCollector(Collector):
    """Reads the node's store counters and tier figures at every scrape (exact, no drift)."""

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
        for tier in store.stats_tiers():
            used.add_metric([tier.name], tier.used_bytes)
            cap.add_metric([tier.name], tier.capacity_bytes)
            pinned.add_metric([tier.name], tier.pinned_bytes)
            blocks.add_metric([tier.name], tier.blocks)
        yield from (used, cap, pinned, blocks)
        labels = ["tier", "namespace", "tenant", "model", "codec"]
        raw = GaugeMetricFamily(
            "sessioncache_tier_raw_bytes", "Bytes of the blocks held, as sent", labels=labels
        )
        stored = GaugeMetricFamily(
            "sessioncache_tier_stored_bytes", "Bytes stored for them (a codec's)", labels=labels
        )
        ratio = GaugeMetricFamily(
            "sessioncache_tier_compression_ratio", "Raw over stored bytes", labels=labels
        )
        for row in stored_bytes(store.tiers, node.codecs, node.owners.describe):
            values = [row.tier, row.root.hex()[:16], row.tenant, row.model, row.codec]
            raw.add_metric(values, row.raw)
            stored.add_metric(values, row.stored)
            ratio.add_metric(values, row.ratio)
        yield from (raw, stored, ratio)
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
            "sessioncache_degraded", "1 while a shared tier or the fleet index is unreachable"
        )
        degraded.add_metric([], 1 if node.health_problems() else 0)
        yield degraded
        behind = store.write_behind
        if behind is not None:
            backlog = GaugeMetricFamily(
                "sessioncache_write_behind_bytes",
                "Bytes of blocks queued for the disk tier (write-behind), per tenant",
                labels=["tenant"],
            )
            for tenant, n in sorted(behind.tenants.snapshot().items()):
                backlog.add_metric([tenant], n)
            yield backlog
            bound = GaugeMetricFamily(
                "sessioncache_write_behind_bound_bytes", "The write-behind queue's bound"
            )
            bound.add_metric([], behind.bound_bytes)
            yield bound
            for name, value, what in (
                ("written", behind.written, "Blocks the write-behind queue copied to disk"),
                ("failed", behind.failed, "Blocks the write-behind queue could not copy"),
            ):
                family = CounterMetricFamily(f"sessioncache_write_behind_{name}", what)
                family.add_metric([], value)
                yield family
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
        yield from namespace_families(node, store)


def namespace_families(node: CacheNode, store: TieredStore) -> Iterator[Any]:
    """Blocks, bytes and hit/miss tokens per namespace root, labelled with its tenant and
    model (the dashboard's namespaces and tenants tables; sum by tenant for tenants)."""
    labels = ["tenant", "model", "namespace"]
    blocks = GaugeMetricFamily("sessioncache_namespace_blocks", "Blocks held", labels=labels)
    held = GaugeMetricFamily("sessioncache_namespace_bytes", "Payload bytes held", labels=labels)
    hit = CounterMetricFamily("sessioncache_namespace_hit_tokens", "Hit tokens", labels=labels)
    miss = CounterMetricFamily("sessioncache_namespace_miss_tokens", "Miss tokens", labels=labels)
    usage = store.namespace_usage()
    tokens = node.namespace_tokens()
    for root in usage.keys() | tokens.keys():
        described = node.describe_root(root)
        tenant, fields = described if described is not None else ("", {})
        values = [tenant, str(fields.get("model", "")), root.hex()[:16]]
        if root in usage:
            blocks.add_metric(values, usage[root].blocks)
            held.add_metric(values, usage[root].bytes)
        if root in tokens:
            hit.add_metric(values, tokens[root].hit)
            miss.add_metric(values, tokens[root].miss)
    yield from (blocks, held, hit, miss)


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


class EngineCollector(Collector):
    """The followed engines (KV-aware routing): blocks held per medium, events, gaps."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def collect(self) -> Iterator[Any]:
        blocks = GaugeMetricFamily(
            "sessioncache_engine_blocks", "Blocks an engine holds", labels=["engine", "medium"]
        )
        stale = GaugeMetricFamily("sessioncache_engine_stale", "1 when silent", labels=["engine"])
        events = CounterMetricFamily(
            "sessioncache_engine_events", "KV events applied", labels=["engine"]
        )
        gaps = CounterMetricFamily(
            "sessioncache_engine_gaps", "Sequence gaps seen", labels=["engine"]
        )
        dropped = CounterMetricFamily(
            "sessioncache_engine_views_dropped", "Gaps the replay could not fill", labels=["engine"]
        )
        for spec in self._router.feeds.specs():
            engine = spec.engine_id
            status = self._router.feeds.status(engine)
            if status is None:
                continue
            try:
                counts, held = self._router.index.counts(engine)
            except KeyError:  # removed meanwhile
                continue
            for medium, count in held.items():
                blocks.add_metric([engine, medium], count)
            stale.add_metric([engine], float(status.stale))
            events.add_metric([engine], counts.events)
            gaps.add_metric([engine], status.gaps)
            dropped.add_metric([engine], status.views_dropped)
        yield from (blocks, stale, events, gaps, dropped)


class TenantCollector(Collector):
    """Per tenant and bound (``quotas.TenantLimits``): what the tenant holds, and its bound."""

    def __init__(self, quotas: Quotas) -> None:
        self._quotas = quotas

    def collect(self) -> Iterator[Any]:
        held = GaugeMetricFamily(
            "sessioncache_tenant_held",
            "What a tenant holds now, per bound",
            labels=["bound", "tenant"],
        )
        limit = GaugeMetricFamily(
            "sessioncache_tenant_limit", "A tenant's bound", labels=["bound", "tenant"]
        )
        for bound, per_tenant in sorted(self._quotas.usage().items()):
            for tenant, count in sorted(per_tenant.items()):
                held.add_metric([bound, tenant], count)
                limit.add_metric([bound, tenant], getattr(self._quotas.of(tenant), bound))
        yield from (held, limit)


def install(app: FastAPI, node: CacheNode, store: TieredStore) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(StoreCollector(node, store))
    registry.register(TenantCollector(node.quotas))
    latency = Histogram(
        "sessioncache_request_seconds",
        "Request latency by route",
        ["method", "route", "status"],
        registry=registry,
        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
    )

    app.add_middleware(LatencyMiddleware, histogram=latency)
    app.state.request_latency = latency  # the dashboard's lookup latency percentiles

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
