"""``POST /v1/store``: phase one of a two-phase store (the server owns the chain)."""

from __future__ import annotations

from fastapi import APIRouter

from sessioncache.api.deps import NodeDep, TenantDep
from sessioncache.api.schemas import ERRORS, StoreRequest, StoreResponse
from sessioncache.operations import stores
from sessioncache.operations.caller import Caller

router = APIRouter(prefix="/v1", tags=["store"])


@router.post("/store", response_model=StoreResponse, responses=ERRORS)
def plan_store(body: StoreRequest, node: NodeDep, tenant: TenantDep) -> StoreResponse:
    """Every full block's id, and those still missing: upload each of the missing with
    ``PUT /v1/blocks/{hash}`` (only ids handed out here to this caller are accepted)."""
    plan = stores.plan_upload(
        node,
        Caller(tenant),
        body.namespace.to_namespace(),
        body.token_bytes(),
        session_id=body.session_id,
        ttl_s=body.ttl_s,
        finish_reason=body.finish_reason,
    )
    return StoreResponse(
        block_tokens=plan.block_tokens,
        hashes=[h.hex() for h in plan.hashes],
        missing=[h.hex() for h in plan.missing],
    )
