"""The ``/metrics`` series that name tenants, models and engines: served only to a scrape with
the metrics or the admin token (``metrics.scrape``), never to an anonymous one.

Their rows are bounded: per tenant (the configured API keys), per followed engine (bounded per
tenant) and per namespace root, of which only the ``top`` most active are listed one by one;
the rest are summed into one row whose ``namespace`` is ``"other"`` (per tier and codec on
the tier series), so a tenant registering namespaces adds no rows.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sessioncache.accounting import TokenCounts
from sessioncache.codecs import stored_bytes
from sessioncache.node import CacheNode
from sessioncache.quotas import Quotas
from sessioncache.routing.scoring import Router
from sessioncache.store import TieredStore
from sessioncache.store.results import NamespaceUsage

OTHER = "other"
"""The ``namespace`` label of the row summing the roots past the top ones."""


def top_roots(
    tokens: Mapping[bytes, TokenCounts], usage: Mapping[bytes, NamespaceUsage], n: int
) -> set[bytes]:
    """The ``n`` most active namespace roots: most hit and miss tokens, then most bytes held."""

    def activity(root: bytes) -> tuple[int, int, bytes]:
        counted = tokens.get(root, TokenCounts())
        held = usage.get(root, NamespaceUsage())
        return counted.hit + counted.miss, held.bytes, root

    return set(heapq.nlargest(n, tokens.keys() | usage.keys(), key=activity))


class NamespaceCollector(Collector):
    """Per namespace root (the ``top`` most active, and ``other``): blocks, bytes and hit/miss
    tokens, and what its blocks take on the tiers that may encode them."""

    def __init__(self, node: CacheNode, store: TieredStore, top: int) -> None:
        self._node = node
        self._store = store
        self._top = top

    def collect(self) -> Iterator[Any]:
        usage = self._store.namespace_usage()
        tokens = self._node.namespace_tokens()
        top = top_roots(tokens, usage, self._top)
        yield from self._namespaces(usage, tokens, top)
        yield from self._tiers(top)

    def _labels(self, root: bytes) -> list[str]:
        described = self._node.describe_root(root)
        tenant, fields = described if described is not None else ("", {})
        return [tenant, str(fields.get("model", "")), root.hex()[:16]]

    def _namespaces(
        self,
        usage: Mapping[bytes, NamespaceUsage],
        tokens: Mapping[bytes, TokenCounts],
        top: set[bytes],
    ) -> Iterator[Any]:
        labels = ["tenant", "model", "namespace"]
        blocks = GaugeMetricFamily("sessioncache_namespace_blocks", "Blocks held", labels=labels)
        held = GaugeMetricFamily(
            "sessioncache_namespace_bytes", "Payload bytes held", labels=labels
        )
        hit = CounterMetricFamily("sessioncache_namespace_hit_tokens", "Hit tokens", labels=labels)
        miss = CounterMetricFamily(
            "sessioncache_namespace_miss_tokens", "Miss tokens", labels=labels
        )
        for root in sorted(top):
            values = self._labels(root)
            if root in usage:
                blocks.add_metric(values, usage[root].blocks)
                held.add_metric(values, usage[root].bytes)
            if root in tokens:
                hit.add_metric(values, tokens[root].hit)
                miss.add_metric(values, tokens[root].miss)
        held_rest = [u for root, u in usage.items() if root not in top]
        counted_rest = [t for root, t in tokens.items() if root not in top]
        if held_rest or counted_rest:
            other = ["", "", OTHER]
            blocks.add_metric(other, sum(u.blocks for u in held_rest))
            held.add_metric(other, sum(u.bytes for u in held_rest))
            hit.add_metric(other, sum(t.hit for t in counted_rest))
            miss.add_metric(other, sum(t.miss for t in counted_rest))
        yield from (blocks, held, hit, miss)

    def _tiers(self, top: set[bytes]) -> Iterator[Any]:
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
        rest: dict[tuple[str, str], tuple[int, int]] = {}  # (tier, codec) -> (raw, stored)
        node = self._node
        for row in stored_bytes(self._store.tiers, node.codecs, node.owners.describe):
            if row.root not in top:
                was_raw, was_stored = rest.get((row.tier, row.codec), (0, 0))
                rest[row.tier, row.codec] = (was_raw + row.raw, was_stored + row.stored)
                continue
            values = [row.tier, row.root.hex()[:16], row.tenant, row.model, row.codec]
            raw.add_metric(values, row.raw)
            stored.add_metric(values, row.stored)
            ratio.add_metric(values, row.ratio)
        for (tier, codec), (raw_sum, stored_sum) in sorted(rest.items()):
            values = [tier, OTHER, "", "", codec]
            raw.add_metric(values, raw_sum)
            stored.add_metric(values, stored_sum)
            ratio.add_metric(values, raw_sum / stored_sum if stored_sum else 1.0)
        yield from (raw, stored, ratio)


class WriteBehindCollector(Collector):
    """Per tenant: its blocks queued for the disk tier (with write-behind on), and the most
    of other tenants' a durable store of its waited for (``WriteBehind.waited_behind``)."""

    def __init__(self, store: TieredStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Any]:
        behind = self._store.write_behind
        if behind is None:
            return
        backlog = GaugeMetricFamily(
            "sessioncache_write_behind_bytes",
            "Bytes of blocks queued for the disk tier (write-behind), per tenant",
            labels=["tenant"],
        )
        for tenant, n in sorted(behind.tenants.snapshot().items()):
            backlog.add_metric([tenant], n)
        waited = GaugeMetricFamily(
            "sessioncache_write_behind_durable_waited_bytes",
            "The most bytes of other tenants' blocks one of a tenant's durable stores waited "
            "for in the write-behind queue",
            labels=["tenant"],
        )
        for tenant, n in sorted(behind.waited_behind().items()):
            waited.add_metric([tenant], n)
        yield from (backlog, waited)


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
