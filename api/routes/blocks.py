"""Block payloads: ``PUT``/``GET /v1/blocks/{hash}`` and the batch read, whose binary framing
is specified in ``sessioncache/dataplane/frames/batch.py`` and docs/api.md."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Annotated

import anyio
from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from sessioncache.api.deps import NodeDep, TenantDep
from sessioncache.api.paths import BlockIdPath
from sessioncache.api.schemas import BlockBatchRequest, ErrorOut, UploadResponse
from sessioncache.buffers import BufferPool, Filling
from sessioncache.dataplane.frames.batch import BATCH_MEDIA_TYPE, batch_head, batch_record
from sessioncache.errors import BlockNotFound, BodyTooLarge, InvalidInput, NoRoom
from sessioncache.hashing import BlockHash, from_hex
from sessioncache.node import CacheNode
from sessioncache.operations import lookups, stores
from sessioncache.operations.caller import Caller
from sessioncache.quotas import Charge
from sessioncache.status import BlockStatus

router = APIRouter(prefix="/v1/blocks", tags=["blocks"])


async def read_body(
    request: Request, limit: int, into: BufferPool, charge: Charge
) -> AsyncIterator[bytearray]:
    """The request body, in a buffer that grows with the bytes received (a pooled one when
    its declared length has one idle: see ``buffers.Filling``), charged to the caller's
    tenant while it is held."""
    declared = request.headers.get("content-length")
    size: int | None = None
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise InvalidInput("Content-Length is not a number") from None
        if size > limit:
            raise BodyTooLarge(f"body of {size} bytes exceeds the limit of {limit}")
    if size is None:
        body = bytearray()
        async for chunk in request.stream():
            charge(len(chunk))
            body += chunk
            if len(body) > limit:
                raise BodyTooLarge(f"body exceeds the limit of {limit} bytes")
        yield body
        return
    filling = Filling(into, size, charge)
    try:
        async for chunk in request.stream():
            filling.append(chunk)
        if not filling.full:
            raise InvalidInput("body shorter than its Content-Length")
        yield filling.buf
    finally:
        into.give([filling.buf])


_UPLOAD_BUFFERS = BufferPool()


@router.put(
    "/{block_hash:blockid}",
    response_model=UploadResponse,
    openapi_extra={
        "requestBody": {
            "content": {
                "application/octet-stream": {
                    "schema": {"type": "string", "format": "binary", "minLength": 1}
                }
            },
            "required": True,
        }
    },
    responses={
        403: {"model": ErrorOut},
        413: {"model": ErrorOut},
        422: {"model": ErrorOut},
        429: {"model": ErrorOut},
        507: {"model": ErrorOut},
    },
)
async def put_block(
    block_hash: BlockIdPath,
    request: Request,
    node: NodeDep,
    tenant: TenantDep,
    durable: Annotated[
        bool,
        Query(
            description="Answer once the block is on the durable tier (fsync-ed); without it "
            "the answer comes once the first tier holds it, and its durable copy follows "
            "(unless the node makes every store durable)"
        ),
    ] = False,
) -> UploadResponse:
    """Upload one block handed out by ``POST /v1/store`` (raw payload bytes)."""
    bid = from_hex(block_hash)
    limit = node.settings.max_body_bytes
    caller = Caller(tenant)
    stores.upload_slot(node, caller, bid)  # a 403 before a byte of the body is read
    with node.inflight.charge(tenant) as charge:
        async with asynccontextmanager(read_body)(request, limit, _UPLOAD_BUFFERS, charge) as body:
            if not body:
                raise InvalidInput("empty payload")
            node.received.add("rest", len(body))
            status = await anyio.to_thread.run_sync(
                functools.partial(stores.upload, node, caller, bid, body, durable=durable)
            )
    if not status.held:
        raise NoRoom(
            f"block {block_hash} was not stored: no tier could make room for it, or its parent "
            "is not held (dropped, or not uploaded yet: upload a chain in order)"
        )
    return UploadResponse(
        hash=block_hash,
        stored=status is BlockStatus.STORED,
        status=status,
        durable=stores.held_durably(node, bid),
    )


@router.get(
    "/{block_hash:blockid}",
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {}}},
        404: {"model": ErrorOut},
        422: {"model": ErrorOut},
    },
)
def get_block(block_hash: BlockIdPath, node: NodeDep, tenant: TenantDep) -> Response:
    """One block's raw payload."""
    data = lookups.read_bytes(node, Caller(tenant), from_hex(block_hash))
    return Response(content=data, media_type="application/octet-stream")


def _records(node: CacheNode, tenant: str, ids: list[BlockHash]) -> Iterator[bytes]:
    caller = Caller(tenant)
    yield batch_head(len(ids))
    for bid in ids:
        try:
            payload: bytes | None = lookups.read_bytes(node, caller, bid)
        except BlockNotFound:
            payload = None
        yield batch_record(bid, payload)


@router.post(
    "/batch",
    response_class=StreamingResponse,
    responses={200: {"content": {BATCH_MEDIA_TYPE: {}}}, 422: {"model": ErrorOut}},
)
def get_blocks(body: BlockBatchRequest, node: NodeDep, tenant: TenantDep) -> StreamingResponse:
    """Many blocks in one response (framing in the module docstring / docs/api.md)."""
    ids = [from_hex(h) for h in body.hashes]
    return StreamingResponse(_records(node, tenant, ids), media_type=BATCH_MEDIA_TYPE)
