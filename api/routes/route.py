"""``POST /v1/route``: which engine holds the longest prefix of a prompt."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool

from sessioncache.api.deps import RouterDep, TenantDep
from sessioncache.api.schemas import ERRORS
from sessioncache.api.schemas_routing import RouteOut, RouteRequest
from sessioncache.routing.scoring import Router

router = APIRouter(prefix="/v1", tags=["routing"])


@router.post("/route", response_model=RouteOut, responses=ERRORS)
async def route(body: RouteRequest, routing: RouterDep, tenant: TenantDep) -> RouteOut:
    """Per engine (the caller's and the shared ones, or those named), the cached prefix of
    the prompt, per medium and scored; best first. ``cache`` is the prefix held in the
    node's own tiers. Hashing a long prompt, and a tenant's first use of a namespace (its
    root goes to the catalog), run on a worker thread."""
    return await run_in_threadpool(_route, body, routing, tenant)


def _route(body: RouteRequest, routing: Router, tenant: str) -> RouteOut:
    namespace = body.namespace.to_namespace()
    ids = body.block_ids()
    answer = routing.route(
        tenant,
        namespace,
        token_bytes=body.token_bytes() if ids is None else None,
        ids=ids,
        engines=body.engines,
    )
    return RouteOut.model_validate(asdict(answer))
