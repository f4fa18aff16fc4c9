"""``POST /v1/namespaces/resolve``: the chain root a client computes block ids from."""

from __future__ import annotations

from fastapi import APIRouter

from sessioncache.api.deps import NodeDep, TenantDep
from sessioncache.api.schemas import ErrorOut, ResolveRequest, ResolveResponse

router = APIRouter(prefix="/v1/namespaces", tags=["namespaces"])


@router.post(
    "/resolve",
    response_model=ResolveResponse,
    responses={401: {"model": ErrorOut}, 422: {"model": ErrorOut}},
)
def resolve(body: ResolveRequest, node: NodeDep, tenant: TenantDep) -> ResolveResponse:
    """The namespace root this node hashes the caller's prompts under (with authentication
    on, salted with the caller's tenant), its block size and the hash seed: block ``i``'s id
    is ``XXH3-128(id_{i-1} || tokens_i as little-endian uint32, hash_seed)`` from ``id_{-1}
    = root`` (docs/hashing.md; ``sessioncache.hashing.block_hashes_from_bytes``). The root is
    recorded as the caller's, like a lookup's or a store's."""
    namespace = body.namespace.to_namespace()
    root = node.namespace_root(tenant, namespace)
    return ResolveResponse(
        root=root.hex(), block_tokens=namespace.block_tokens, hash_seed=node.settings.hash_seed
    )
