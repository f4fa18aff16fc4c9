"""The write side of the operation layer: a store's plan, its blocks, and what a finished store
means for its session.

Every store is one prepared write of the store (``TieredStore.prepare``, a ``Write``) that a
carrier fills in its own way:

- REST: ``plan_upload`` prepares a write of the missing blocks of a prompt and hands out an
  upload slot for each, filled by one ``upload`` (``PUT /v1/blocks/{id}``);
- the stream: ``plan_store`` derives a segment's ids and prepares its write; each block's
  payload is read from the socket and filled by ``store_block``;
- the same host: ``stage`` reserves slots in shared memory for a planned segment's write,
  which the caller fills in place and ``commit`` publishes (or ``abort`` frees).

Tenancy: the node derives every id itself from the parent and the tokens (or keys), and a
segment's parent must be the root or a block held under it, so nobody plants a payload under
an id they could not have derived from their own chain.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from sessioncache.errors import (
    BlockNotFound,
    InvalidInput,
    SessionNotFound,
    StoreRefused,
    UploadRefused,
)
from sessioncache.hashing import BlockHash, Namespace, segment_ids
from sessioncache.node import CacheNode
from sessioncache.operations import sessions
from sessioncache.operations.caller import Caller
from sessioncache.operations.lookups import readable_meta, resolve
from sessioncache.operations.messages import StoreRequest
from sessioncache.status import BlockStatus, kept
from sessioncache.store import Write
from sessioncache.store.forecast import finish_class
from sessioncache.store.uploads import UploadSlot
from sessioncache.tiers.base import StagedSlot
from sessioncache.tiers.payload import Payload, as_memoryview

STORED, PRESENT, DROPPED, REJECTED = (
    BlockStatus.STORED,
    BlockStatus.PRESENT,
    BlockStatus.DROPPED,
    BlockStatus.REJECTED,
)


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
    finish_reason: str | None = None,
) -> UploadPlan:
    """Phase one of a REST store: every id of the prompt, and upload slots for the missing.
    ``finish_reason`` (with ``session_id``): the request whose KV this is has finished."""
    if ttl_s is not None and not ttl_s > 0:
        raise InvalidInput(f"ttl_s must be positive, got {ttl_s}")
    check_finish(session_id, finish_reason)
    tenant = caller.tenant
    root = resolve(node, caller, namespace)
    hashes = node.hashes(tenant, namespace, token_bytes)
    if session_id is not None:
        ttl_s = max(ttl_s or 0.0, node.sessions.get(session_id, tenant=tenant).ttl_s)
    # The node's own probe, not an engine's question: counted in no lookup counter.
    match = node.store.reads.lookup(hashes, ttl_s=ttl_s, counted=False)
    # The match is a prefix; past it, blocks may still be held beyond a hole: one pass under
    # the store's lock instead of a lock round per block.
    start = match.num_blocks
    wanted = [
        i
        for i, held in enumerate(node.store.reads.contains_many(hashes[start:]), start)
        if not held
    ]
    missing = [hashes[i] for i in wanted]
    if missing:
        write = node.store.writes.prepare(
            missing,
            namespace_root=root,
            nbytes=None,
            parents=[hashes[i - 1] if i else None for i in wanted],
            ttl_s=ttl_s,
            durable=node.durable_uploads,
            next_use=_forecast(node, tenant, session_id, finish_reason),
        )
        if session_id is not None:  # the session's chain moves once the uploads are answered
            record = (session_id, hashes, bytes(token_bytes), namespace.block_tokens)
            sessions.record_plan(node, caller, *record, finish_reason, write=write, wanted=wanted)
        node.uploads.open_many(tenant, missing, write, session_id=session_id)
    elif session_id is not None:  # nothing to upload: the chain is the session's now
        record = (session_id, hashes, bytes(token_bytes), namespace.block_tokens)
        sessions.record_plan(node, caller, *record, finish_reason)
    return UploadPlan(namespace.block_tokens, hashes, missing)


def check_finish(session_id: str | None, finish_reason: str | None) -> None:
    """A store's ``finish_reason``: a known one (``forecast.FINISH_CLASSES``), of a session's
    request (``InvalidInput`` otherwise), checked before the store does anything."""
    if finish_reason is None:
        return
    finish_class(finish_reason)
    if session_id is None:
        raise InvalidInput(
            "finish_reason says a session's request has finished: give the session_id too"
        )


def upload_slot(node: CacheNode, caller: Caller, block_hash: BlockHash) -> UploadSlot:
    """The caller's open upload slot for ``block_hash`` (``UploadRefused`` without one):
    checked before a byte of the upload is read, and again when it is stored."""
    slot = node.uploads.peek(caller.tenant, block_hash)
    if slot is None:
        raise UploadRefused(
            f"block {block_hash.hex()} was not handed out to this caller by POST /v1/store "
            "(or its upload slot expired)"
        )
    return slot


def upload(
    node: CacheNode,
    caller: Caller,
    block_hash: BlockHash,
    payload: Payload,
    *,
    durable: bool = False,
) -> BlockStatus:
    """Phase two: store one handed-out block; with ``durable`` (or ``durable_uploads``) it
    is on the durable tier when this returns, else its copy there follows (write-behind).
    ``PRESENT`` when it was already held, ``DROPPED`` when no tier could make room for it.
    Its durability is this upload's own, whatever the plan's other uploads ask."""
    tenant = caller.tenant
    slot = upload_slot(node, caller, block_hash)
    if slot.used and _same_as_held(node, block_hash, payload):
        return PRESENT  # a retry whose first answer was lost
    writes = node.store.writes
    sync = writes.sync_for(slot.write, durable=durable)
    try:
        status = writes.fill(slot.write, slot.index, payload, sync=sync)
        writes.settle(slot.write, sync)
    finally:
        if slot.session_id is not None:  # the plan's last answer records its session's chain
            sessions.uploaded(node, slot)
    if status is DROPPED:
        return DROPPED  # the slot stays open: a later try may find room
    node.uploads.mark_used(tenant, block_hash)
    return status


def held_durably(node: CacheNode, block_hash: BlockHash) -> bool:
    """Whether a durable tier holds the block now (what an answer's ``durable`` says)."""
    meta = node.store.reads.meta(block_hash)
    tiers = node.store.tiers
    return meta is not None and any(tiers[t].durable for t in meta.tiers)


def _same_as_held(node: CacheNode, block_hash: BlockHash, payload: Payload) -> bool:
    """Whether the store holds ``block_hash`` with exactly ``payload``; raises
    ``UploadRefused`` when it holds other bytes. False when it no longer holds it (the retry
    stores it again)."""
    try:
        held = node.store.reads.get_bytes(block_hash, promote=False)
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
    write: Write
    """The segment's prepared write: its ids, parents, TTL and durability."""

    @property
    def status(self) -> list[BlockStatus]:
        """Each block's status so far (``dropped``: not filled, after a block not held)."""
        return [s or DROPPED for s in self.write.status]

    @property
    def ids(self) -> list[BlockHash]:
        return self.write.hashes

    @property
    def durable(self) -> bool:
        return self.write.durable_tier is not None


def plan_store(
    node: CacheNode, caller: Caller, request: StoreRequest, *, tier: str | None = None
) -> StorePlan:
    """Check a segment's root, parent and session, derive its ids and prepare its write into
    ``tier`` (default: the store's choice), all before any payload is read."""
    namespace = caller.namespace(request.root)
    check_finish(request.session_id, request.finish_reason)
    if not request.keyed and request.block_tokens != namespace.block_tokens:
        raise InvalidInput(
            f"a store of {request.block_tokens}-token blocks in a namespace of "
            f"{namespace.block_tokens}-token blocks"
        )
    if request.parent is not None:
        meta = readable_meta(node, caller.tenant, BlockHash(request.parent))
        if (
            meta is None
            or not meta.tiers
            or not _may_hang_off(caller, request, namespace, meta.namespace_root)
        ):
            raise StoreRefused(
                f"parent {request.parent.hex()} is not held under root {request.root.hex()}"
                + (" or a related group's root" if request.keyed else "")
                + ": LOOKUP the chain first, or store from an earlier block"
            )
    ttl_s = request.ttl_s
    if request.session_id is not None:
        session = node.sessions.get(request.session_id, tenant=caller.tenant)
        ttl_s = max(ttl_s or 0.0, session.ttl_s)
    seed = node.settings.hash_seed
    parent = BlockHash(request.parent) if request.parent is not None else None
    ids = segment_ids(
        request.root,
        request.parent,
        request.units,
        request.block_tokens,
        keyed=request.keyed,
        seed=seed,
    )
    if request.linked:
        parents: list[BlockHash | None] = [parent, *ids[:-1]]
    else:
        parents = [parent, *[None] * (len(ids) - 1)]
    write = node.store.writes.prepare(
        ids,
        namespace_root=request.root,
        nbytes=request.block_nbytes,
        parents=parents,
        ttl_s=ttl_s,
        tier=tier,
        durable=request.durable or node.durable_uploads,
        next_use=_forecast(node, caller.tenant, request.session_id, request.finish_reason),
    )
    return StorePlan(request, write)


def _forecast(
    node: CacheNode, tenant: str, session_id: str | None, finish_reason: str | None
) -> float | None:
    """The forecast of the blocks a session's store makes (``SessionForecasts.next_use``)."""
    if session_id is None:
        return None
    finish = finish_class(finish_reason) if finish_reason is not None else None
    return node.sessions.forecasts.next_use((tenant, session_id), finish)


def _may_hang_off(
    caller: Caller, request: StoreRequest, namespace: Namespace, parent_root: bytes
) -> bool:
    """A segment continues a chain of its own root; keyed blocks of a hybrid model's group
    (a state checkpoint, a window) may also hang off a chain block of another group of the same
    model and tenant (``Namespace.related``, both roots resolved by the caller), so that they
    leave the store before that block, tail first (docs/hybrid.md)."""
    if parent_root == request.root:
        return True
    if not request.keyed:
        return False
    parent_ns = caller.roots.get(parent_root)
    return parent_ns is not None and namespace.related(parent_ns)


def store_block(node: CacheNode, plan: StorePlan, index: int, payload: Payload) -> BlockStatus:
    """Store block ``index`` of the plan (its whole payload received); returns its status.
    After a dropped block the rest of the segment is dropped (``TieredStore.writes.fill``).
    A durable plan's blocks reach the durable tier at ``settle``, several per sync."""
    return node.store.writes.fill(plan.write, index, payload)


def settle(node: CacheNode, plan: StorePlan) -> None:
    """A durable plan: wait until its stored blocks are on the durable tier
    (``DurableStoreFailed`` when one could not be)."""
    node.store.writes.settle(plan.write)


def complete(node: CacheNode, caller: Caller, plan: StorePlan, kept: int) -> None:
    """A segment's first ``kept`` blocks are held: for a named session its chain now ends
    there (TTL slid, chain pinned, head set) and it is the session's previous prompt. A
    ``finish_reason`` files the chain under the forecast that follows (``sessions.record``),
    even when none of the blocks was held."""
    request = plan.request
    session_id = request.session_id
    if session_id is None:
        return
    if not kept:  # nothing held: the session's chain is what it was (as over REST)
        if request.finish_reason is not None:
            with contextlib.suppress(SessionNotFound):  # closed or expired since the plan
                node.sessions.record(
                    session_id, tenant=caller.tenant, finish_reason=request.finish_reason
                )
        return
    ids = plan.ids[:kept]
    if request.parent is not None and (request.linked or request.keyed):
        # a chain segment, or a group's objects hanging off another group's chain: the
        # session pins the chain to its parent and them (the latest checkpoint)
        chain = [*node.store.reads.chain_to(BlockHash(request.parent)), *ids]
    else:
        chain = list(ids)
    try:
        node.sessions.record(
            session_id, chain, tenant=caller.tenant, finish_reason=request.finish_reason
        )
    except SessionNotFound:
        return  # closed or expired since the plan: the blocks are stored all the same
    whole = not request.keyed and request.parent is None
    tokens = request.units[: 4 * request.block_tokens * kept] if whole else None
    node.attribution.stored((caller.tenant, session_id), chain, tokens)


# -- the same host: staged slots ------------------------------------------------------------


@dataclass(slots=True)
class Staged:
    """A staging handed to a caller: its key, the plan (its write's slots reserved), and each
    block's status (``STORED``: a slot to fill, until committed)."""

    key: bytes
    plan: StorePlan
    charged: int = 0
    """Bytes of slots it holds against its tenant's pins (``CacheNode.staged``)."""

    @property
    def write(self) -> Write:
        return self.plan.write

    @property
    def status(self) -> list[BlockStatus]:
        return self.plan.status


def stage(node: CacheNode, caller: Caller, request: StoreRequest) -> Staged:
    """Slots in the shared-memory tier for a planned segment, held by the caller until
    ``commit`` or ``abort`` (or its end): as many as the caller's share of the tier admits
    (``reads.hold``); the blocks past them are ``DROPPED``, as when the tier has no room."""
    caller.room_for_staging()
    shm = node.store.shared_memory_tier_name
    if shm is None:
        raise InvalidInput("this store has no shared-memory tier (the same-host path is off)")
    plan = plan_store(node, caller, request, tier=shm)
    nbytes, admitted = plan.write.nbytes or 0, 0
    try:
        budget = node.pin_budget(caller.tenant)
        admitted = node.store.reads.hold(budget, shm, nbytes, len(plan.write.hashes))
        node.store.writes.reserve(plan.write, admitted)
    except BaseException:
        node.staged.add(caller.tenant, -admitted * nbytes)
        node.store.writes.abort(plan.write)
        raise
    key = secrets.token_bytes(16)
    reserved = plan.write.status.count(STORED) * nbytes
    staged = caller.stagings[key] = Staged(key, plan, reserved)
    node.staged.add(caller.tenant, reserved - admitted * nbytes)  # present or dropped: free
    return staged


def unstage(node: CacheNode, caller: Caller, staged: Staged) -> None:
    """A staging closed (committed whole, aborted, or its caller gone): its charge goes."""
    node.staged.add(caller.tenant, -staged.charged)
    staged.charged = 0


def commit(
    node: CacheNode,
    caller: Caller,
    key: bytes,
    start: int,
    checksums: list[int],
    nbytes: list[int],
    *,
    copy_in: Callable[[int, StagedSlot], int] | None = None,
) -> tuple[Staged, list[BlockStatus]]:
    """Publish blocks ``start ..`` of one of the caller's stagings whose slots hold what the
    caller says it wrote (length and XXH3-64); each block's status. The blocks are committed
    in order, in one call or several; once the last is, the staging is closed and its session
    (if any) completed. ``copy_in``: see ``writes.commit``."""
    staged = caller.staging(key)
    write = staged.write
    if start != write.claimed:
        raise InvalidInput(
            f"COMMIT from block {start}; the staging is committed up to {write.claimed}"
        )
    try:
        status = node.store.writes.commit(write, checksums, nbytes, copy_in=copy_in).status
    finally:
        if not write.open:
            unstage(node, caller, caller.stagings.pop(key))
    if not write.open:
        complete(node, caller, staged.plan, kept(staged.status))
    return staged, status


def abort(node: CacheNode, caller: Caller, key: bytes) -> int:
    """Free one of the caller's stagings (an unknown key is no error); slots freed."""
    staged = caller.stagings.pop(key, None)
    if staged is None:
        return 0
    unstage(node, caller, staged)
    return node.store.writes.abort(staged.write)
