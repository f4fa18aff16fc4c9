"""Resolve, lookup, exists, locate, load and release: the read side of the operation layer.

Admission: every lease (a lookup's of any carrier, a locate's, a load's by ids) is admitted
against the caller's share of each tier with its size, with the lease itself
(``CacheNode.pin_budget``, ``reads.lookup``): a lease that would pass the share leases the
prefix that fits, and the match is cut to it (``Match.cut``); not one block: ``QuotaExceeded``.

Declined: a lookup whose caller says it will load nothing (``LookupRequest.declined``) reads
the index only: it matches nothing, takes no lease, touches no block nor session (no TTL, LRU,
pin or head moves), and counts every token it asks as missed, the run the caller may read and
the node holds as ``declined`` (``attribution``), so that the session's attribution says why
nothing was loaded.

Tenancy: a root is usable by a caller once ``resolve`` derived it from the caller's own
namespace (with authentication on, the tenant salts it: ``hashing.tenant_namespace``). A
lookup by ids matches only the run of them linked to that root (``chain_prefix``), so nobody
reads, touches or leases a block under another tenant's root; ids the node derived itself
from the caller's tokens are the caller's by construction.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from sessioncache.attribution import Lookup, MissReport
from sessioncache.errors import BlockNotFound, InvalidInput, LeaseNotFound, SessionNotFound
from sessioncache.hashing import BlockHash, Namespace
from sessioncache.node import CacheNode
from sessioncache.operations.caller import Caller, CallerLease
from sessioncache.operations.messages import LookupRequest, LookupResult
from sessioncache.quotas import PinBudget
from sessioncache.store import LocatedSlot, Match
from sessioncache.store.blocks import BlockMeta
from sessioncache.store.index import Lease
from sessioncache.tiers.payload import as_memoryview

LEASE_MARGIN_S = 0.05
"""A block is not sent on a lease with less left than this."""


# -- resolve --------------------------------------------------------------------------------


def resolve(node: CacheNode, caller: Caller, namespace: Namespace) -> bytes:
    """The caller's root of ``namespace``, usable by the caller from now on."""
    root = node.namespace_root(caller.tenant, namespace)
    caller.remember(root, namespace)
    return root


def chain_prefix(node: CacheNode, root: bytes, hashes: Sequence[BlockHash]) -> int:
    """How many of ``hashes``, from the first, may match for a caller whose chain starts at
    ``root``: block 0 is a held chain root under ``root`` and each next id is the held child
    of the one before it. A block's root and parent never change (its id is their digest), so
    linkage to the caller's block 0 proves the whole run is the caller's.

    Reads the index only (a lookup by ids adopts what a fleet's shared tier holds first).
    Cheap for the lookups clients make (a held run followed by blocks not held): two record
    reads, a binary search for the end of the held run, and one ``chain_to`` walk compared
    with the ids. Only a run with a hole or a foreign id reads the records one by one, up to
    the first that does not fit."""
    store = node.store
    if not hashes:
        return 0
    first = store.reads.meta(hashes[0])
    if first is None or first.parent is not None or first.namespace_root != root:
        return 0
    lo, hi = 1, len(hashes)
    while lo < hi:  # the last held block, assuming the held blocks are a prefix
        mid = (lo + hi + 1) // 2
        if store.reads.contains(hashes[mid - 1]):
            lo = mid
        else:
            hi = mid - 1
    # chain_to walks the whole held ancestry of the block: only for one of the caller's own
    # chains (not a deep foreign one named after block 0), and then compared
    last = store.reads.meta(hashes[lo - 1]) if lo > 1 else first
    if (
        last is not None
        and last.namespace_root == root
        and store.reads.chain_to(hashes[lo - 1]) == list(hashes[:lo])
    ):
        return lo
    for i in range(1, lo):  # a hole in the held run, or ids that are no chain
        meta = store.reads.meta(hashes[i])
        if meta is None or meta.parent != hashes[i - 1] or not meta.tiers:
            return i
    return lo


# -- lookup ---------------------------------------------------------------------------------


def _match(
    node: CacheNode,
    tenant: str,
    hashes: Sequence[BlockHash],
    *,
    session_id: str | None,
    lease_s: float | None,
    budget: PinBudget | None,
    counted: bool,
) -> Match:
    """The store's lookup, on behalf of a session when one is named (its TTL, pins, head),
    its lease admitted against ``budget``; ``counted`` in the store's lookup counters."""
    if session_id is not None:
        return node.sessions.lookup(
            session_id, hashes, tenant=tenant, lease_s=lease_s, budget=budget, counted=counted
        )
    return node.store.reads.lookup(hashes, lease_s=lease_s, budget=budget, counted=counted)


def _keep_lease(caller: Caller, match: Match) -> bytes | None:
    """The caller's key for the match's lease, for a caller that keeps its leases (the
    store's lease id never leaves the node on the data plane)."""
    lease = match.lease
    if lease is None or not caller.keeps_leases:
        return None
    key = secrets.token_bytes(16)
    caller.leases[key] = CallerLease(lease.id, list(lease.hashes), lease.expires_at)
    return key


def lookup(
    node: CacheNode, caller: Caller, request: LookupRequest, *, locate: bool = False
) -> LookupResult:
    """The longest held prefix of ``request.ids`` the caller may read, leased on request (as
    far as the caller's share admits; ``locate``: the leased blocks are then copied into the
    shared-memory tier), on behalf of its session; a ``counted`` one (a question an engine
    asks) is counted in the store's lookup counters and the token totals, and attributed
    (module docstring)."""
    root = request.root
    namespace = caller.namespace(root)
    block_tokens = namespace.block_tokens
    ids = request.ids
    if request.declined:
        return _declined(node, caller, request, block_tokens)
    budget = None
    if request.lease_s is not None:
        caller.room_for_lease(node.store.clock.now())
        budget = node.pin_budget(caller.tenant, locate=locate)
    if request.keyed:
        held = node.store.reads.held_under(root, ids)
        own = held.index(False) if False in held else len(held)
    elif request.tokens is not None:
        own = len(ids)  # derived by the node from the caller's own tokens
    else:
        node.store.reads.adopt_elsewhere(ids)  # a restart's disk, the fleet's shared tier
        own = chain_prefix(node, root, ids)
    match = _match(
        node,
        caller.tenant,
        ids[:own],
        session_id=request.session_id,
        lease_s=request.lease_s,
        budget=budget,
        counted=request.counted,
    )
    key = _keep_lease(caller, match)
    nbytes = 0
    if match.hashes:
        first = node.store.reads.meta(match.hashes[0])
        nbytes = first.nbytes if first is not None else 0
    miss = None
    if request.counted:
        asked = len(request.tokens) // 4 if request.tokens is not None else len(ids) * block_tokens
        miss = _account(node, caller, request, match.num_blocks, block_tokens, asked)
    every = ids if isinstance(ids, list) else list(ids)
    return LookupResult(block_tokens, every, match, key, nbytes, miss)


def _declined(
    node: CacheNode, caller: Caller, request: LookupRequest, block_tokens: int
) -> LookupResult:
    """A declined lookup (module docstring): the held run the caller may read, read off the
    index, counted as missed."""
    if request.lease_s is not None:
        raise InvalidInput("a declined lookup takes no lease: its caller loads nothing")
    if not request.counted:
        raise InvalidInput("a declined lookup is a prompt's question: it is counted")
    if request.session_id is not None:  # SessionNotFound unless open and the caller's
        node.sessions.get(request.session_id, tenant=caller.tenant)
    root, ids = request.root, request.ids
    reads = node.store.reads
    if request.keyed:
        held = reads.held_under(root, ids)
    else:
        # ids the node derived from the caller's tokens are the caller's; others are proved
        # linked to its root (read off the index: nothing adopted, nothing touched)
        own = len(ids) if request.tokens is not None else chain_prefix(node, root, ids)
        held = reads.contains_many(ids[:own])
    run = held.index(False) if False in held else len(held)
    asked = len(request.tokens) // 4 if request.tokens is not None else len(ids) * block_tokens
    miss = _account(node, caller, request, run, block_tokens, asked, declined=True)
    every = ids if isinstance(ids, list) else list(ids)
    return LookupResult(block_tokens, every, Match([], [], None), None, 0, miss)


def _account(
    node: CacheNode,
    caller: Caller,
    request: LookupRequest,
    matched: int,
    block_tokens: int,
    asked: int,
    *,
    declined: bool = False,
) -> MissReport:
    """Count and attribute a lookup's tokens (``declined``: the ``matched`` blocks held, none
    of them hit)."""
    session_id = request.session_id
    session = (caller.tenant, session_id) if session_id is not None else None
    hit = 0 if declined else matched * block_tokens
    node.accounting.count(hit, asked, root=request.root, session=session)
    tokens = bytes(request.tokens) if request.tokens is not None and session is not None else None
    lookup = Lookup(request.root, request.ids, matched, block_tokens, asked, tokens)
    return node.attribution.lookup(lookup, session=session, declined=declined)


def lookup_tokens(
    node: CacheNode,
    caller: Caller,
    namespace: Namespace,
    token_bytes: bytes,
    *,
    session_id: str | None = None,
    lease_s: float | None = None,
    declined: bool = False,
) -> LookupResult:
    """``lookup`` of a prompt's full blocks, the ids derived here from its tokens."""
    root = resolve(node, caller, namespace)
    ids = node.hashes(caller.tenant, namespace, token_bytes)
    request = LookupRequest(
        root, ids, lease_s=lease_s, session_id=session_id, tokens=token_bytes, declined=declined
    )
    return lookup(node, caller, request)


def lookup_ids(
    node: CacheNode,
    caller: Caller,
    namespace: Namespace,
    ids: Sequence[BlockHash],
    *,
    session_id: str | None = None,
    lease_s: float | None = None,
    declined: bool = False,
) -> LookupResult:
    """``lookup`` of ids the caller derived itself from its root of ``namespace``, at most
    the node's ``max_tokens`` of them (as a lookup by tokens)."""
    if len(ids) * namespace.block_tokens > node.settings.max_tokens:
        raise InvalidInput(
            f"{len(ids)} blocks of {namespace.block_tokens} tokens exceed the limit of "
            f"{node.settings.max_tokens} tokens"
        )
    root = resolve(node, caller, namespace)
    request = LookupRequest(root, ids, lease_s=lease_s, session_id=session_id, declined=declined)
    return lookup(node, caller, request)


def exists(
    node: CacheNode, caller: Caller, root: bytes, ids: Sequence[BlockHash], *, counted: bool
) -> list[bool]:
    """Which of ``ids`` the node holds under ``root`` (resolved by the caller), each on its
    own, chained or keyed; nothing is touched nor leased. A ``counted`` one is a prompt's
    question (an LMCache lookup is one): one lookup in the store's counters, its held ids
    hit tokens and the others miss tokens. Blocks only in the fleet's shared tier are not
    asked for (a lookup adopts them)."""
    namespace = caller.namespace(root)
    held = node.store.reads.held_under(root, ids, counted=counted and bool(ids))
    if counted and ids:
        bt = namespace.block_tokens
        node.accounting.count(sum(held) * bt, len(ids) * bt, root=root)
        missed = [h for h, ok in zip(ids, held, strict=True) if not ok]
        if missed:
            node.attribution.each(root, missed, bt)
    return held


def locate(
    node: CacheNode, caller: Caller, request: LookupRequest
) -> tuple[LookupResult, list[LocatedSlot]]:
    """A leased ``lookup``, and where its blocks lie in the shared-memory tier (blocks held
    only lower are copied there first; the located run stops where that was not possible)."""
    if not request.lease_s:
        raise InvalidInput("a locate needs a lease (lease_ms > 0): it guards the slots")
    found = lookup(node, caller, request, locate=True)
    if found.key is None:
        return found, []
    return found, node.store.reads.locate(caller.leases[found.key].hashes)


# -- release --------------------------------------------------------------------------------


def release(node: CacheNode, caller: Caller, key: bytes) -> None:
    """End one of the caller's leases (``LeaseNotFound`` when over or unknown)."""
    lease = caller.leases.pop(key, None)
    if lease is None:
        raise LeaseNotFound(f"no lease {key.hex()} on this connection")
    node.store.reads.release(lease.store_id)


def release_checked(node: CacheNode, caller: Caller, key: bytes) -> bool:
    """Release a lease of the caller; whether it was still live, that is whether its blocks
    stayed pinned from the lookup until now (never an error)."""
    try:
        release(node, caller, key)
    except LeaseNotFound:
        return False
    return True


def release_by_id(node: CacheNode, caller: Caller, lease_id: str) -> None:
    """End a lease named by the store's id (the REST API hands those out). Another tenant's
    is ``LeaseNotFound`` like an unknown one, so that a lease id (which travels in logs and
    traces) gives no handle on another tenant's blocks. A lease pins one matched prefix, all
    under one namespace root: its first block says whose it is."""
    hashes = node.store.reads.lease_hashes(lease_id)
    if hashes is None or (hashes and readable_meta(node, caller.tenant, hashes[0]) is None):
        raise LeaseNotFound(f"no live lease {lease_id!r}")
    node.store.reads.release(lease_id)


# -- load -----------------------------------------------------------------------------------


def readable_meta(node: CacheNode, tenant: str, block_hash: BlockHash) -> BlockMeta | None:
    """A snapshot of the block's record when ``tenant`` may read it, else None (not held, or
    under another tenant's namespace root)."""
    meta = node.store.reads.meta(block_hash)
    if meta is None:
        return None
    owner = node.owners.owner(meta.namespace_root)
    if owner == tenant or (owner is None and not node.auth_enabled):
        return meta
    return None


def read_bytes(node: CacheNode, caller: Caller, block_hash: BlockHash) -> bytes:
    """A copy of a block's payload, for the tenant owning its namespace only."""
    if readable_meta(node, caller.tenant, block_hash) is None:
        raise BlockNotFound(f"block {block_hash.hex()} is not held")
    return node.store.reads.get_bytes(block_hash)


@dataclass(slots=True)
class LoadPlan:
    """What a load sends: ``hashes`` (None: a block reported missing; then ``missing`` more),
    each before ``expires_at``; ``release`` is the store lease to release afterwards."""

    hashes: list[BlockHash | None]
    missing: int
    expires_at: float
    release: str | None = None
    key: bytes | None = None


def plan_load_lease(
    node: CacheNode,
    caller: Caller,
    key: bytes,
    start: int,
    blocks: int,
    *,
    release: bool,
    session_id: str | None = None,
) -> LoadPlan:
    """Blocks ``start .. start + blocks`` of one of the caller's leases (its lookup counted
    them, on behalf of its session); with ``release`` the lease ends after the load. A
    ``session_id`` must name an open session of the caller's."""
    if session_id is not None:
        node.sessions.get(session_id, tenant=caller.tenant)
    lease = caller.leases.get(key)
    if lease is None or lease.expires_at <= node.store.clock.now():
        caller.leases.pop(key, None)
        raise LeaseNotFound(f"no live lease {key.hex()} on this connection (released or expired)")
    end = start + blocks
    if end > len(lease.hashes):
        raise InvalidInput(f"blocks {start}..{end} asked of a lease on {len(lease.hashes)} blocks")
    return LoadPlan(
        list(lease.hashes[start:end]),
        0,
        lease.expires_at,
        lease.store_id if release else None,
        key if release else None,
    )


def _readable(node: CacheNode, caller: Caller, block_hash: BlockHash) -> BlockMeta | bool:
    """The block's record when the caller may read it; False when it may not; True when the
    node does not hold it (or not yet: blocks of the shared tier are indexed by a lookup)."""
    meta = readable_meta(node, caller.tenant, block_hash)
    if meta is None:
        return node.store.reads.meta(block_hash) is None
    return meta


def plan_load_ids(
    node: CacheNode,
    caller: Caller,
    ids: Sequence[BlockHash],
    *,
    lease_s: float,
    each: bool = False,
    session_id: str | None = None,
) -> LoadPlan:
    """The held prefix of ``ids`` the caller may read (with ``each``: every held one), leased
    for ``lease_s`` while it is sent, as far as the caller's share admits (the others answer
    missing), on behalf of ``session_id`` (its TTL, pins and head follow what is sent;
    ``SessionNotFound`` before anything else when it is not open or not the caller's). Not
    counted: a load moves blocks a lookup or an exists already counted."""
    if session_id is not None:
        node.sessions.get(session_id, tenant=caller.tenant)
    budget = node.pin_budget(caller.tenant)
    if each:
        plan = _plan_each(node, caller, list(ids), lease_s, budget)
        sent = [h for h in plan.hashes if h is not None]
    else:
        metas, lease = _leased_run(node, caller, list(ids), lease_s, budget)
        sent = [m.block_hash for m in metas]
        plan = LoadPlan(
            [*sent],
            len(ids) - len(metas),
            lease.expires_at if lease is not None else 0.0,
            lease.id if lease is not None else None,
        )
    if session_id is not None and sent:
        # after the screening: the session records only blocks the caller may read
        with contextlib.suppress(SessionNotFound):  # closed since: the load goes on
            node.sessions.record(session_id, sent, tenant=caller.tenant)
    return plan


def _leased_run(
    node: CacheNode,
    caller: Caller,
    ids: list[BlockHash],
    lease_s: float,
    budget: PinBudget,
) -> tuple[list[BlockMeta], Lease | None]:
    """The records of the held prefix of ``ids`` the caller may read, and a lease on it.

    Ids are screened before the lookup, so that a lookup never touches (nor leases) a block
    of another tenant: the ids are cut at the first one held for someone else. Blocks the
    lookup itself brings in (from the shared tier) are checked after it."""
    screened: list[BlockMeta] = []
    for i, block_hash in enumerate(ids):
        verdict = _readable(node, caller, block_hash)
        if verdict is True:
            break
        if verdict is False:
            ids = ids[:i]
            break
        screened.append(verdict)
    if not ids:
        return [], None
    match = node.store.reads.lookup(ids, lease_s=lease_s, budget=budget, counted=False)
    metas = screened[: match.num_blocks]
    for i in range(len(metas), match.num_blocks):
        verdict = _readable(node, caller, match.hashes[i])
        if isinstance(verdict, bool):
            # Rare: a block adopted from the shared tier is not the caller's (or went away).
            # Lease only what the caller may read.
            if match.lease is not None:
                node.store.reads.release(match.lease.id)
            if not i:
                return [], None
            again = node.store.reads.lookup(
                match.hashes[:i], lease_s=lease_s, budget=budget, counted=False
            )
            return metas[: again.num_blocks], again.lease
        metas.append(verdict)
    return metas, match.lease


def _plan_each(
    node: CacheNode,
    caller: Caller,
    ids: list[BlockHash],
    lease_s: float,
    budget: PinBudget,
) -> LoadPlan:
    """Every id on its own: the ids the caller may read that are held are leased together
    while they are sent (as far as ``budget`` admits); the others answer missing."""
    readable = [isinstance(_readable(node, caller, h), BlockMeta) for h in ids]
    wanted = [h for h, ok in zip(ids, readable, strict=True) if ok]
    match = (
        node.store.reads.lookup(wanted, lease_s=lease_s, budget=budget, counted=False)
        if wanted
        else None
    )
    leased = set(match.hashes) if match is not None else set()
    # ids after a block that went away since the screening are not leased: missing too
    plan: list[BlockHash | None] = [h if h in leased else None for h in ids]
    lease = match.lease if match is not None else None
    return LoadPlan(
        plan,
        0,
        lease.expires_at if lease is not None else 0.0,
        lease.id if lease is not None else None,
    )


def read_block(
    node: CacheNode, plan: LoadPlan, block_hash: BlockHash
) -> tuple[memoryview | None, float]:
    """A block's payload to send (a view of tier memory where the tier gives one; None when
    the block is gone), and the seconds its send must finish within: a view of a block whose
    lease ran out could be overwritten while the kernel still copies from it, so the sender
    gives up (and closes) rather than send past the lease."""
    left = plan.expires_at - node.store.clock.now() - LEASE_MARGIN_S
    if left <= 0:
        raise LeaseNotFound("the lease ran out before all its blocks were sent: look up again")
    try:
        return as_memoryview(node.store.reads.get(block_hash)), left
    except BlockNotFound:
        return None, left


def finish_load(node: CacheNode, caller: Caller, plan: LoadPlan) -> None:
    if plan.key is not None:
        caller.leases.pop(plan.key, None)
    if plan.release is not None:
        with contextlib.suppress(LeaseNotFound):
            node.store.reads.release(plan.release)
