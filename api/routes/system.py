"""Operations: ``/v1/stats``, ``/v1/whoami``, ``/healthz``, ``/readyz``, ``/metrics``."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from sessioncache.api.deps import AdminDep, NodeDep, SessionsDep, StoreDep, TenantDep
from sessioncache.api.metrics import Metrics
from sessioncache.api.schemas import GcOut, StatsOut, TierStatsOut, WhoAmI

router = APIRouter(tags=["system"])


@router.get("/v1/whoami", response_model=WhoAmI)
def whoami(node: NodeDep, tenant: TenantDep) -> WhoAmI:
    return WhoAmI(tenant=tenant, auth=node.auth_enabled)


@router.get("/v1/stats", response_model=StatsOut)
def stats(store: StoreDep, sessions: SessionsDep, tenant: TenantDep) -> StatsOut:
    s = store.stats()
    return StatsOut(
        blocks=s.blocks,
        pinned_blocks=s.pinned_blocks,
        leases=s.leases,
        sessions=sessions.count(),
        tiers=[TierStatsOut(**asdict(t)) for t in s.tiers],
        counters=asdict(s.counters),
    )


@router.post("/v1/gc", response_model=GcOut)
def gc(sessions: SessionsDep, admin: AdminDep) -> GcOut:
    """Admin (the admin token): sweep now: expire sessions past their TTL, unpin idle ones,
    drop expired blocks."""
    report = sessions.sweep()
    return GcOut(**asdict(report))


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get(
    "/readyz",
    responses={
        200: {"description": "ready, or degraded (serving from local tiers) unless strict"},
        503: {"description": "strict, and degraded"},
    },
)
def readyz(node: NodeDep, strict: bool = False) -> JSONResponse:
    """Ready to serve. A node whose shared tier or fleet index is unreachable still serves
    from its local tiers, so it answers 200 with ``status: degraded`` and the reasons: a
    Redis outage hits every node at once, and failing readiness would take the whole fleet
    out of its load balancer. ``?strict=true`` answers 503 while degraded, for probes that
    want to know (alerts, a balancer preferring fully healthy nodes), and while the catalog
    cannot be used (down, locked, read-only). ``dependencies`` names each thing the node
    stands on (the catalog, the disk and Redis tiers, the fleet index) with ``ok`` or why it
    fails now."""
    problems = node.health_problems()
    body = {
        "status": "degraded" if problems else "ready",
        "problems": problems,
        "dependencies": node.dependencies(),
    }
    return JSONResponse(body, status_code=503 if strict and problems else 200)


@router.get("/metrics", response_class=Response)
def metrics(request: Request) -> Response:
    """Prometheus text format: the node-wide series; with the metrics or the admin token as
    bearer key, also those naming tenants, models and engines (docs/metrics.md)."""
    registries: Metrics = request.app.state.metrics
    return Response(registries.scrape(request), media_type=CONTENT_TYPE_LATEST)
