"""The figures the dashboard shows, as JSON-ready dicts built from a node.

Every number here is also on ``/metrics`` (docs/metrics.md names the series), so a Grafana
board and the dashboard agree. Functions of the node only: no HTTP in here.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from sessioncache.api.metrics import Collectable, latency_quantiles
from sessioncache.codecs import stored_bytes
from sessioncache.node import CacheNode
from sessioncache.sessions.manager import Session
from sessioncache.store import TieredStore
from sessioncache.tiers.base import CheckedTier

MAX_CHAIN = 4096
"""Most blocks a session's detail draws (the strip of a longer chain is cut)."""


def overview(node: CacheNode, store: TieredStore, request_latency: Collectable) -> dict[str, Any]:
    stats = store.stats()
    tokens = node.token_counts()
    asked = tokens.hit + tokens.miss
    rate = node.settings.prefill_tokens_per_s
    recent = node.history.recent_rates() if node.history is not None else None
    count, (p50, p95, p99) = latency_quantiles(request_latency)
    down = {t.name for t in store.tiers if isinstance(t, CheckedTier) and t.problem() is not None}
    return {
        "at": time.time(),
        "blocks": stats.blocks,
        "pinned_blocks": stats.pinned_blocks,
        "leases": stats.leases,
        "sessions": node.sessions.count(),
        "counters": asdict(stats.counters),
        "prefill": {
            "hit_tokens": tokens.hit,
            "computed_tokens": tokens.miss,
            "hit_rate": tokens.hit / asked if asked else None,
            "prefill_tokens_per_s": rate,
            "gpu_seconds_saved": tokens.hit / rate,
        },
        # miss tokens by reason (diverged, evicted, expired, new): docs/prompt-stability.md
        "miss_reasons": node.attribution.miss_tokens(),
        "rates": asdict(recent) if recent is not None else None,
        "lookup_latency_s": {"count": count, "p50": p50, "p95": p95, "p99": p99},
        "tiers": [{**asdict(t), "up": t.name not in down} for t in stats.tiers],
        # per tier and namespace, what a block codec saves there (docs/codecs.md)
        "stored": [
            {
                "tier": r.tier,
                "namespace": r.root.hex()[:16],
                "tenant": r.tenant,
                "model": r.model,
                "codec": r.codec,
                "raw_bytes": r.raw,
                "stored_bytes": r.stored,
                "ratio": round(r.ratio, 3),
            }
            for r in stored_bytes(store.tiers, node.codecs, node.owners.describe)
        ],
        "fleet": fleet(node),
        "problems": node.health_problems(),
    }


def fleet(node: CacheNode) -> dict[str, Any] | None:
    """The fleet index's live nodes (None without one). Asks Redis: call off the event loop."""
    if node.fleet is None:
        return None
    now = time.time()
    nodes = [
        {
            "node_id": info.node_id,
            "url": info.info.get("url"),
            "heartbeat_lapses_in_s": round(info.deadline - now, 1),
            "healthy": info.deadline > now,
            "self": info.node_id == node.fleet.member.partition("#")[0],
        }
        for info in sorted(node.fleet.nodes().values(), key=lambda i: i.node_id)
    ]
    return {"nodes": nodes, "problem": node.fleet.problem(), "pending": node.fleet.pending}


def history(node: CacheNode, since: float | None = None) -> dict[str, Any]:
    if node.history is None:
        return {"interval_s": None, "samples": []}
    return {
        "interval_s": node.history.interval_s,
        "samples": [asdict(s) for s in node.history.samples(since)],
    }


def namespaces(node: CacheNode, store: TieredStore) -> dict[str, Any]:
    """Blocks, bytes and hit rate per namespace root, and the same summed per tenant with
    what each tenant holds against its bounds (``bounds``: bound -> held, limit)."""
    usage = store.namespace_usage()
    tokens = node.namespace_tokens()
    rows: list[dict[str, Any]] = []
    tenants: dict[str, dict[str, Any]] = {}
    for root in usage.keys() | tokens.keys():
        described = node.describe_root(root)
        tenant, fields = described if described is not None else ("?", {})
        held = usage.get(root)
        counted = tokens.get(root)
        row: dict[str, Any] = {
            "root": root.hex(),
            "tenant": tenant,
            "model": fields.get("model"),
            "block_tokens": fields.get("block_tokens"),
            "kv_dtype": fields.get("kv_dtype"),
            "lora": fields.get("lora"),
            "blocks": held.blocks if held else 0,
            "bytes": held.bytes if held else 0,
            "hit_tokens": counted.hit if counted else 0,
            "miss_tokens": counted.miss if counted else 0,
        }
        rows.append(row)
        total = tenants.setdefault(
            tenant,
            {"tenant": tenant, "namespaces": 0, "blocks": 0, "bytes": 0},
        )
        total["namespaces"] += 1
        for key in ("blocks", "bytes", "hit_tokens", "miss_tokens"):
            total[key] = total.get(key, 0) + row[key]
    for bound, per_tenant in node.quotas.usage().items():
        for tenant, count in per_tenant.items():
            total = tenants.setdefault(
                tenant, {"tenant": tenant, "namespaces": 0, "blocks": 0, "bytes": 0}
            )
            limit = getattr(node.quotas.of(tenant), bound)
            total.setdefault("bounds", {})[bound] = {"held": count, "limit": limit}
    for row in [*rows, *tenants.values()]:
        asked = row.get("hit_tokens", 0) + row.get("miss_tokens", 0)
        row["hit_rate"] = row.get("hit_tokens", 0) / asked if asked else None
    rows.sort(key=lambda r: r["bytes"], reverse=True)
    return {
        "namespaces": rows,
        "tenants": sorted(tenants.values(), key=lambda r: r["bytes"], reverse=True),
    }


def session_row(store: TieredStore, session: Session, hit_tokens: int) -> dict[str, Any]:
    chain = store.reads.chain_tiers(session.head) if session.head is not None else []
    return {
        "id": session.id,
        "tenant": session.tenant,
        "kind": session.kind,
        "ttl_s": session.ttl_s,
        "created": session.created,
        "last_seen": session.last_seen,
        "expires_at": session.expires_at,
        "pinned": session.pinned,
        "blocks": len(chain),
        "bytes": sum(meta.nbytes for meta, _ in chain),
        "pinned_bytes": sum(meta.nbytes for meta, _ in chain) if session.pinned else 0,
        "hit_tokens": hit_tokens,
    }


def session_detail(node: CacheNode, store: TieredStore, session: Session) -> dict[str, Any]:
    """The session's row and its chain, root first, each block with the tiers holding it."""
    chain = store.reads.chain_tiers(session.head) if session.head is not None else []
    hits = node.session_hit_tokens([session.key])[session.key]
    return {
        **session_row(store, session, hits),
        "tiers": store.tier_names(),
        "chain_truncated": len(chain) > MAX_CHAIN,
        "chain": [
            {
                "id": meta.block_hash.hex(),
                "tiers": tiers,
                "nbytes": meta.nbytes,
                "hit_count": meta.hit_count,
                "pinned": meta.pins > 0,
                "expires_at": meta.expires_at,
            }
            for meta, tiers in chain[:MAX_CHAIN]
        ],
    }
