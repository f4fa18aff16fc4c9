"""``POST /v1/lookup``: the longest cached prefix of a prompt's full blocks."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import NodeDep, TenantDep
from api.schemas import BlockRef, ErrorOut, LeaseOut, LookupRequest, LookupResponse

router = APIRouter(prefix="/v1", tags=["lookup"])


@router.post(
    "/lookup",
    response_model=LookupResponse,
    responses={401: {"model": ErrorOut}, 404: {"model": ErrorOut}, 422: {"model": ErrorOut}},
)
def lookup(body: LookupRequest, node: NodeDep, tenant: TenantDep) -> LookupResponse:
    result = node.lookup(
        tenant,
        body.namespace.to_namespace(),
        body.token_bytes(),
        session_id=body.session_id,
        lease_s=body.lease_ms / 1000 if body.lease_ms is not None else None,
    )
    match = result.match
    return LookupResponse(
        block_tokens=result.block_tokens,
        matched_blocks=match.num_blocks,
        matched_tokens=match.num_blocks * result.block_tokens,
        blocks=[
            BlockRef(hash=h.hex(), tier=t) for h, t in zip(match.hashes, match.tiers, strict=True)
        ],
        lease=LeaseOut(id=match.lease.id, expires_at=match.lease.expires_at)
        if match.lease
        else None,
    )


@router.delete("/leases/{lease_id}", status_code=204, responses={404: {"model": ErrorOut}})
def release_lease(lease_id: str, node: NodeDep, tenant: TenantDep) -> None:
    node.release(lease_id)
