"""``POST /v1/lookup``: the longest cached prefix of a prompt's full blocks."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Response
from fastapi.concurrency import run_in_threadpool

from sessioncache.api.deps import NodeDep, TenantDep
from sessioncache.api.paths import LeaseIdPath
from sessioncache.api.schemas import (
    ERRORS,
    CompactLookupResponse,
    ErrorOut,
    LookupRequest,
    LookupResponse,
)
from sessioncache.attribution import MissReport
from sessioncache.hashing import HASH_BYTES, BlockHash, Namespace
from sessioncache.node import CacheNode
from sessioncache.operations import lookups
from sessioncache.operations.caller import Caller

router = APIRouter(prefix="/v1", tags=["lookup"])


INLINE_MAX_BLOCKS = 8192
"""Lookups of at most this many blocks (~4 ms of work) that wait on no I/O run on the event
loop: a worker thread would hold the GIL for them anyway, and the hop to it and back cost
about 0.25 ms of CPU, a sixth of a 2,048-block lookup by id. Longer ones go to a worker
thread, so that the loop keeps answering in between."""


@router.post(
    "/lookup",
    response_model=LookupResponse | CompactLookupResponse,
    responses=ERRORS,
)
async def lookup(body: LookupRequest, node: NodeDep, tenant: TenantDep) -> Response:
    """By tokens (the server computes the ids) or by ``block_ids_b64`` (ids the client
    computed from ``POST /v1/namespaces/resolve``'s root; only blocks of the caller's chain
    under ``namespace`` match). ``compact`` answers without the per-block list
    (``CompactLookupResponse``); it is the default for lookups by id. ``declined``: the
    caller loads nothing; the node matches nothing and counts why (``miss``)."""
    namespace = body.namespace.to_namespace()
    ids = body.block_ids()
    if ids is not None:
        blocks = len(ids)
    elif body.tokens is not None:
        blocks = len(body.tokens) // namespace.block_tokens
    else:
        blocks = len(body.tokens_b64 or "") * 3 // 16 // namespace.block_tokens
    if (
        blocks > INLINE_MAX_BLOCKS
        or body.locations
        or node.lookup_waits_on_io(tenant, namespace, session_id=body.session_id)
    ):
        return await run_in_threadpool(_lookup, body, namespace, node, tenant)
    return _lookup(body, namespace, node, tenant)


def _lookup(body: LookupRequest, namespace: Namespace, node: CacheNode, tenant: str) -> Response:
    lease_s = body.lease_ms / 1000 if body.lease_ms is not None else None
    ids = body.block_ids()
    caller = Caller(tenant)
    if ids is None:
        result = lookups.lookup_tokens(
            node,
            caller,
            namespace,
            body.token_bytes(),
            session_id=body.session_id,
            lease_s=lease_s,
            declined=body.declined,
        )
    else:
        result = lookups.lookup_ids(
            node,
            caller,
            namespace,
            ids,
            session_id=body.session_id,
            lease_s=lease_s,
            declined=body.declined,
        )
    match = result.match
    lease = match.lease
    out: dict[str, Any] = {
        "block_tokens": result.block_tokens,
        "matched_blocks": match.num_blocks,
        "matched_tokens": match.num_blocks * result.block_tokens,
        "lease": {"id": lease.id, "expires_at": lease.expires_at} if lease else None,
        "lease_cut": match.cut,
        "locations": node.locations(match.hashes) if body.locations else None,
    }
    out["miss"] = miss_json(result.miss) if body.explain and result.miss is not None else None
    runs = tier_runs(match.tiers)
    if body.answer_compact:
        out["tiers"] = [{"tier": tier, "blocks": count} for tier, count in runs]
        text = json.dumps(out, separators=(",", ":"))
    else:
        # Serialised by hand: a 128K-token prompt matches thousands of blocks, and one dict
        # per block through json.dumps cost more than the lookup itself. The shape is
        # LookupResponse's (tests/api check it against the model).
        text = (
            '{"blocks":'
            + blocks_json(match.hashes, runs)
            + ","
            + json.dumps(out, separators=(",", ":"))[1:]
        )
    return Response(text, media_type="application/json")


def miss_json(miss: MissReport) -> dict[str, Any]:
    """``MissOut`` as a dict (every field, as the model dumps it)."""
    first = miss.first
    return {
        "reason": first.reason if first else None,
        "block": first.block if first else None,
        "token": first.token if first else None,
        "offset": first.offset if first else None,
        "tier": first.tier if first else None,
        "ago_s": first.ago_s if first else None,
        "pressure": first.pressure if first else None,
        "tokens": miss.tokens,
    }


def tier_runs(tiers: list[str]) -> list[tuple[str, int]]:
    """``tiers`` run-length encoded, in order: ``[(tier, count), ...]``."""
    if not tiers:
        return []
    first = tiers[0]
    if tiers.count(first) == len(tiers):  # the usual case, at C speed
        return [(first, len(tiers))]
    runs: list[tuple[str, int]] = []
    current, count = first, 0
    for tier in tiers:
        if tier == current:
            count += 1
        else:
            runs.append((current, count))
            current, count = tier, 1
    runs.append((current, count))
    return runs


def blocks_json(hashes: Sequence[BlockHash], runs: list[tuple[str, int]]) -> str:
    """``[{"hash": "<hex>", "tier": "<tier>"}, ...]`` as compact JSON, built per tier run with
    C-speed string operations: the ids of a run hex-encoded in one call with a one-character
    separator, which is then replaced by the text between two ids."""
    parts = []
    start = 0
    for tier, count in runs:
        tail = ',"tier":' + json.dumps(tier) + "}"
        ids = b"".join(hashes[start : start + count]).hex(",", HASH_BYTES)
        parts.append('{"hash":"' + ids.replace(",", '"' + tail + ',{"hash":"') + '"' + tail)
        start += count
    return "[" + ",".join(parts) + "]"


@router.delete("/leases/{lease_id}", status_code=204, responses={404: {"model": ErrorOut}})
def release_lease(lease_id: LeaseIdPath, node: NodeDep, tenant: TenantDep) -> None:
    """End a lease of the caller's: an unknown one and another tenant's are both 404."""
    lookups.release_by_id(node, Caller(tenant), lease_id)
