"""``POST /v1/lookup``: the longest cached prefix of a prompt's full blocks."""

from __future__ import annotations

import json

from fastapi import APIRouter, Response

from sessioncache.api.deps import NodeDep, TenantDep
from sessioncache.api.schemas import ERRORS, ErrorOut, LookupRequest, LookupResponse

router = APIRouter(prefix="/v1", tags=["lookup"])


@router.post("/lookup", response_model=LookupResponse, responses=ERRORS)
def lookup(body: LookupRequest, node: NodeDep, tenant: TenantDep) -> Response:
    result = node.lookup(
        tenant,
        body.namespace.to_namespace(),
        body.token_bytes(),
        session_id=body.session_id,
        lease_s=body.lease_ms / 1000 if body.lease_ms is not None else None,
    )
    match = result.match
    lease = match.lease
    # Serialised by hand: a 128K-token prompt matches thousands of blocks, and building and
    # re-validating one pydantic model per block cost more than the lookup itself. The shape
    # is LookupResponse's (tests/api check it against the model).
    out = {
        "block_tokens": result.block_tokens,
        "matched_blocks": match.num_blocks,
        "matched_tokens": match.num_blocks * result.block_tokens,
        "blocks": [
            {"hash": h.hex(), "tier": t} for h, t in zip(match.hashes, match.tiers, strict=True)
        ],
        "lease": {"id": lease.id, "expires_at": lease.expires_at} if lease else None,
        "locations": node.locations(match.hashes) if body.locations else None,
    }
    return Response(json.dumps(out, separators=(",", ":")), media_type="application/json")


@router.delete("/leases/{lease_id}", status_code=204, responses={404: {"model": ErrorOut}})
def release_lease(lease_id: str, node: NodeDep, tenant: TenantDep) -> None:
    node.release(lease_id)
