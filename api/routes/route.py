"""``POST /v1/route``: which engine holds the longest prefix of a prompt."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Response
from fastapi.concurrency import run_in_threadpool

from sessioncache.api.deps import RouterDep, TenantDep
from sessioncache.api.schemas import ERRORS
from sessioncache.api.schemas_routing import RouteOut, RouteRequest
from sessioncache.routing.scoring import Router

router = APIRouter(prefix="/v1", tags=["routing"])


@router.post("/route", response_model=RouteOut, responses=ERRORS)
async def route(body: RouteRequest, routing: RouterDep, tenant: TenantDep) -> Response:
    """Per engine (the caller's and the shared ones, or those named), the cached prefix of
    the prompt, per medium and scored; best first. ``cache`` is the prefix held in the
    node's own tiers."""
    # On a worker thread, unlike short lookups: a route hashes and matches long prompts, and on
    # the event loop it would stop the other requests' bodies being read (docs/benchmarks.md,
    # "KV-aware routing").
    return await run_in_threadpool(_route, body, routing, tenant)


def _route(body: RouteRequest, routing: Router, tenant: str) -> Response:
    namespace = body.namespace.to_namespace()
    ids = body.block_ids()
    answer = routing.route(
        tenant,
        namespace,
        token_bytes=body.token_bytes() if ids is None else None,
        ids=ids,
        engines=body.engines,
    )
    cache = answer.cache
    # by hand, not through the response model: a few dicts, a third of the route's time
    # through dataclasses.asdict and validation (RouteOut is the shape; tests check it)
    out: dict[str, Any] = {
        "prompt_tokens": answer.prompt_tokens,
        "engines": [
            {
                "engine_id": e.engine_id,
                "block_tokens": e.block_tokens,
                "matched_blocks": e.matched_blocks,
                "matched_tokens": e.matched_tokens,
                "per_medium": e.per_medium,
                "score": e.score,
                "stale": e.stale,
                "shared": e.shared,
            }
            for e in answer.engines
        ],
        "cache": {
            "block_tokens": cache.block_tokens,
            "matched_blocks": cache.matched_blocks,
            "matched_tokens": cache.matched_tokens,
            "score": cache.score,
        },
    }
    return Response(json.dumps(out, separators=(",", ":")), media_type="application/json")
