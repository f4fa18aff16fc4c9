"""The write side of the operation layer: a store's plan, its blocks, and what a finished store
means for its session.

Three carriers fill a planned store:

- REST: ``plan_upload`` hands out upload slots for the missing blocks of a prompt, each filled
  by one ``upload`` (``PUT /v1/blocks/{id}``);
- the stream: ``plan_store`` derives a segment's ids, each block's payload is read from the
  socket and written by ``store_block``;
- the same host: ``stage`` reserves slots in shared memory for a planned segment, which the
  caller fills in place and ``commit`` publishes (or ``abort`` frees).

Tenancy: the node derives every id itself from the parent and the tokens (or keys), and a
segment's parent must be the root or a block held under it, so nobody plants a payload under
an id they could not have derived from their own chain.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from sessioncache.errors import (
    BlockNotFound,
    InvalidInput,
    SessionNotFound,
    StoreRefused,
    UploadRefused,
)
from sessioncache.hashing import (
    HASH_BYTES,
    BlockHash,
    Namespace,
    block_hashes_from_bytes,
    keyed_block_ids,
)
from sessioncache.node import CacheNode
from sessioncache.operations.caller import Caller
from sessioncache.operations.lookups import readable_meta, resolve
from sessioncache.operations.messages import StoreRequest
from sessioncache.store import DROPPED as STAGE_DROPPED
from sessioncache.store import PRESENT as STAGE_PRESENT
from sessioncache.store import STAGED, CommitResult, Staging
from sessioncache.tiers.payload import Payload, as_memoryview

STORED, PRESENT, DROPPED, REJECTED = "stored", "present", "dropped", "rejected"
"""A block's status after a store (the one vocabulary of every carrier)."""


# -- REST: upload slots ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UploadPlan:
    block_tokens: int
    hashes: list[BlockHash]
    missing: list[BlockHash]


def plan_upload(
    node: CacheNode,
    caller: Caller,
    namespace: Namespace,
    token_bytes: bytes,
    *,
    session_id: str | None = None,
    ttl_s: float | None = None,
) -> UploadPlan:
    """Phase one of a REST store: every id of the prompt, and upload slots for the missing."""
    if ttl_s is not None and not ttl_s > 0:
        raise InvalidInput(f"ttl_s must be positive, got {ttl_s}")
    tenant = caller.tenant
    root = resolve(node, caller, namespace)
    hashes = node.hashes(tenant, namespace, token_bytes)
    if session_id is not None:
        ttl_s = max(ttl_s or 0.0, node.sessions.get(session_id, tenant=tenant).ttl_s)
    match = node.store.lookup(hashes, ttl_s=ttl_s)
    # The match is a prefix; past it, blocks may still be held beyond a hole: one pass under
    # the store's lock instead of a lock round per block.
    start = match.num_blocks
    missing: list[BlockHash] = []
    for i, held in enumerate(node.store.contains_many(hashes[start:]), start):
        if held:
            continue
        missing.append(hashes[i])
        node.uploads.open(
            tenant,
            hashes[i],
            namespace_root=root,
            parent=hashes[i - 1] if i else None,
            ttl_s=ttl_s,
            session_id=session_id,
        )
    if session_id is not None and hashes:
        node.sessions.record(session_id, hashes, tenant=tenant)
        node.attribution.stored(session_id, tenant, hashes, bytes(token_bytes))
    return UploadPlan(namespace.block_tokens, hashes, missing)


def upload(node: CacheNode, caller: Caller, block_hash: BlockHash, payload: Payload) -> bool:
    """Phase two: store one handed-out block; with ``durable_uploads`` (and a durable tier) it
    is on disk when this returns. Returns False when it was already held."""
    tenant = caller.tenant
    slot = node.uploads.peek(tenant, block_hash)
    if slot is None:
        raise UploadRefused(
            f"block {block_hash.hex()} was not handed out to this caller by POST /v1/store "
            "(or its upload slot expired)"
        )
    if slot.used and _same_as_held(node, block_hash, payload):
        return False  # a retry whose first answer was lost
    result = node.store.put(
        [block_hash],
        [payload],
        namespace_root=slot.namespace_root,
        parent=slot.parent,
        ttl_s=slot.ttl_s,
        durable=node.durable_uploads,
    )
    node.uploads.mark_used(tenant, block_hash)
    if slot.session_id is not None and result.stored:
        node.sessions.adopt(slot.session_id, result.stored)
    return bool(result.stored)


def _same_as_held(node: CacheNode, block_hash: BlockHash, payload: Payload) -> bool:
    """Whether the store holds ``block_hash`` with exactly ``payload``; raises
    ``UploadRefused`` when it holds other bytes. False when it no longer holds it (the retry
    stores it again)."""
    try:
        held = node.store.get_bytes(block_hash, promote=False)
    except BlockNotFound:
        return False
    if memoryview(held) != as_memoryview(payload):
        raise UploadRefused(
            f"block {block_hash.hex()} is already stored with other bytes; a repeated upload "
            "must carry the same payload"
        )
    return True


# -- the data plane: a planned segment ------------------------------------------------------


@dataclass(slots=True)
class StorePlan:
    request: StoreRequest
    ids: list[BlockHash]
    ttl_s: float | None
    durable: bool
    parents: list[BlockHash | None]
    """Each block's parent: the previous block of a chain segment (``parent`` for block 0)."""
    status: list[str] = field(default_factory=list)


def plan_store(node: CacheNode, caller: Caller, request: StoreRequest) -> StorePlan:
    """Check a segment's root, parent and session and derive its ids (before any payload is
    read)."""
    namespace = caller.namespace(request.root)
    if not request.keyed and request.block_tokens != namespace.block_tokens:
        raise InvalidInput(
            f"a store of {request.block_tokens}-token blocks in a namespace of "
            f"{namespace.block_tokens}-token blocks"
        )
    if request.parent is not None:
        meta = readable_meta(node, caller.tenant, BlockHash(request.parent))
        if meta is None or not meta.tiers or meta.namespace_root != request.root:
            raise StoreRefused(
                f"parent {request.parent.hex()} is not held under root {request.root.hex()}: "
                "LOOKUP the chain first, or store from an earlier block"
            )
    ttl_s = request.ttl_s
    if request.session_id is not None:
        session = node.sessions.get(request.session_id, tenant=caller.tenant)
        ttl_s = max(ttl_s or 0.0, session.ttl_s)
    seed = node.settings.hash_seed
    parent = BlockHash(request.parent) if request.parent is not None else None
    units = request.units
    if request.keyed:
        keys = [units[i : i + HASH_BYTES] for i in range(0, len(units), HASH_BYTES)]
        ids = keyed_block_ids(request.root, keys, seed)
    else:
        start = request.parent if request.parent is not None else request.root
        ids = block_hashes_from_bytes(start, units, request.block_tokens, seed)
    if request.linked:
        parents: list[BlockHash | None] = [parent, *ids[:-1]]
    else:
        parents = [parent, *[None] * (len(ids) - 1)]
    return StorePlan(request, ids, ttl_s, node.durable_uploads, parents)


def store_block(node: CacheNode, plan: StorePlan, index: int, payload: Payload) -> str:
    """Store block ``index`` of the plan (its whole payload received); returns its status.
    After a dropped block the rest of the segment is dropped unread (it would hang off it)."""
    if plan.status and plan.status[-1] == DROPPED:
        plan.status.append(DROPPED)
        return DROPPED
    result = node.store.put(
        [plan.ids[index]],
        [payload],
        namespace_root=plan.request.root,
        parent=plan.parents[index],
        ttl_s=plan.ttl_s,
        durable=plan.durable,
    )
    status = STORED if result.stored else PRESENT if result.present else DROPPED
    plan.status.append(status)
    return status


def complete(node: CacheNode, caller: Caller, plan: StorePlan, kept: int) -> None:
    """A segment's first ``kept`` blocks are held: for a named session its chain now ends
    there (TTL slid, chain pinned, head set) and it is the session's previous prompt."""
    request = plan.request
    session_id = request.session_id
    if session_id is None or not kept:
        return  # nothing held: the session's chain is what it was (as over REST)
    ids = plan.ids[:kept]
    if request.linked and request.parent is not None:
        chain = [*node.store.chain_to(BlockHash(request.parent)), *ids]
    else:
        chain = list(ids)
    try:
        node.sessions.record(session_id, chain, tenant=caller.tenant)
    except SessionNotFound:
        return  # closed or expired since the plan: the blocks are stored all the same
    whole = not request.keyed and request.parent is None
    tokens = request.units[: 4 * request.block_tokens * kept] if whole else None
    node.attribution.stored(session_id, caller.tenant, chain, tokens)


# -- the same host: staged slots ------------------------------------------------------------

_STAGE_STATUS = {STAGED: STORED, STAGE_PRESENT: PRESENT, STAGE_DROPPED: DROPPED}


@dataclass(slots=True)
class Staged:
    """A staging handed to a caller: its key, the plan, and each block's status (``STORED``:
    a slot to fill)."""

    key: bytes
    plan: StorePlan
    staging: Staging
    status: list[str]


def stage(node: CacheNode, caller: Caller, request: StoreRequest) -> Staged:
    """Slots in the shared-memory tier for a planned segment, held by the caller until
    ``commit`` or ``abort`` (or its end)."""
    caller.room_for_staging()
    plan = plan_store(node, caller, request)
    staging = node.store.stage(
        plan.ids,
        namespace_root=request.root,
        nbytes=request.block_nbytes,
        parent=BlockHash(request.parent) if request.parent is not None else None,
        ttl_s=plan.ttl_s,
        durable=plan.durable,
        parents=None if request.linked else plan.parents,
    )
    key = secrets.token_bytes(16)
    status = [_STAGE_STATUS.get(s, DROPPED) for s in staging.status]
    staged = caller.stagings[key] = Staged(key, plan, staging, status)
    return staged


def commit(
    node: CacheNode,
    caller: Caller,
    key: bytes,
    start: int,
    checksums: list[int],
    nbytes: list[int],
) -> tuple[Staged, list[str]]:
    """Publish blocks ``start ..`` of one of the caller's stagings whose slots hold what the
    caller says it wrote (length and XXH3-64); each block's status. The blocks are committed
    in order, in one call or several; once the last is, the staging is closed and its session
    (if any) completed."""
    staged = caller.staging(key)
    staging = staged.staging
    if start != staging.claimed:
        raise InvalidInput(
            f"COMMIT from block {start}; the staging is committed up to {staging.claimed}"
        )
    result = node.store.commit(staging, checksums, nbytes)
    status = _commit_status(result, staging.hashes[start : start + len(checksums)])
    staged.status[start : start + len(status)] = status
    if not staging.open:
        del caller.stagings[key]
        complete(node, caller, staged.plan, kept(staged.status))
    return staged, status


def _commit_status(result: CommitResult, ids: list[BlockHash]) -> list[str]:
    status = {h: STORED for h in result.stored}
    status.update((h, PRESENT) for h in result.present)
    status.update((h, REJECTED) for h in result.rejected)
    return [status.get(h, DROPPED) for h in ids]


def kept(status: list[str]) -> int:
    """How many blocks from the first are held (stored or present)."""
    for i, s in enumerate(status):
        if s not in (STORED, PRESENT):
            return i
    return len(status)


def abort(node: CacheNode, caller: Caller, key: bytes) -> int:
    """Free one of the caller's stagings (an unknown key is no error); slots freed."""
    staged = caller.stagings.pop(key, None)
    return node.store.abort(staged.staging) if staged is not None else 0
