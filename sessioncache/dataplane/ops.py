"""The data plane's operations: small functions over a ``CacheNode`` and one connection's
``Peer`` state. No I/O here: ``server.py`` reads a request's body, calls these, and writes
their answer (a Unix-socket or shared-memory carrier calls the same functions).

Tenancy, as in the REST API: the peer's tenant comes from its HELLO's API key; a root is usable
on a connection once RESOLVE derived it there from the tenant's own namespace; a LOOKUP or
LOAD sees a block only if ``CacheNode.owned_meta`` says the tenant may read it and it hangs off
that root; a STORE derives every id itself from the parent and the tokens, and its parent
must be the root or a block held under it, so nobody plants a payload under an id they could
not have derived from their own chain.
"""

from __future__ import annotations

import contextlib
import secrets
from dataclasses import dataclass, field
from typing import NamedTuple

from sessioncache.blocks import BlockMeta
from sessioncache.dataplane.errors import AuthRefused, StoreRefused
from sessioncache.dataplane.frames import (
    DROPPED,
    PRESENT,
    STORED,
    Exists,
    HelloOk,
    Limits,
    LoadIds,
    LoadLease,
    Lookup,
    LookupOk,
    StoreHead,
)
from sessioncache.errors import BlockNotFound, InvalidInput, LeaseNotFound
from sessioncache.hashing import (
    HASH_BYTES,
    BlockHash,
    Namespace,
    block_hashes_from_bytes,
    keyed_block_ids,
)
from sessioncache.index import Lease
from sessioncache.node import CacheNode
from sessioncache.tiers.payload import Payload, as_memoryview

MAX_ROOTS = 4096
"""Roots one connection remembers (the oldest is forgotten past this; RESOLVE it again)."""
MAX_LEASES = 4096
"""Live leases one connection may hold."""


@dataclass(slots=True)
class PeerLease:
    """A lease a LOOKUP took for this connection."""

    store_id: str
    hashes: list[BlockHash]
    expires_at: float
    """In the store's clock."""


@dataclass(slots=True)
class Peer:
    """One authenticated connection's state."""

    tenant: str
    roots: dict[bytes, Namespace] = field(default_factory=dict)
    leases: dict[bytes, PeerLease] = field(default_factory=dict)


# -- HELLO and RESOLVE -------------------------------------------------------------------------


def admit(node: CacheNode, local: bool) -> None:
    """Without API keys the node serves peers on this host only (as the REST API binds
    loopback only then)."""
    if not node.auth_enabled and not local:
        raise AuthRefused("this node runs without API keys and serves local peers only")


def authenticate(node: CacheNode, api_key: str | None) -> Peer:
    tenant = node.tenant_for_key(api_key)
    if tenant is None:
        raise AuthRefused("a valid API key is required in HELLO")
    return Peer(tenant)


def hello_ok(node: CacheNode, peer: Peer, limits: Limits) -> HelloOk:
    return HelloOk(peer.tenant, node.auth_enabled, tuple(node.store.tier_names()), limits)


def resolve(node: CacheNode, peer: Peer, namespace: Namespace) -> bytes:
    """The tenant's root of ``namespace``, usable on this connection from now on."""
    root = node.namespace_root(peer.tenant, namespace)
    peer.roots.pop(root, None)
    peer.roots[root] = namespace
    while len(peer.roots) > MAX_ROOTS:
        del peer.roots[next(iter(peer.roots))]
    return root


def _namespace_of(peer: Peer, root: bytes) -> Namespace:
    namespace = peer.roots.get(root)
    if namespace is None:
        raise StoreRefused(f"root {root.hex()} was not resolved on this connection: RESOLVE first")
    return namespace


# -- LOOKUP and RELEASE ------------------------------------------------------------------------


def _readable(
    node: CacheNode, peer: Peer, block_hash: BlockHash, root: bytes | None
) -> BlockMeta | bool:
    """The block's record when the peer may read it (under ``root``, when given); False when
    it may not; True when the node does not hold it (or not yet: blocks of the shared tier
    are indexed by a lookup), so that it is up to the lookup."""
    meta = node.owned_meta(peer.tenant, block_hash)
    if meta is None:
        return node.store.meta(block_hash) is None
    return meta if root is None or meta.namespace_root == root else False


def _leased_run(
    node: CacheNode,
    peer: Peer,
    root: bytes | None,
    ids: list[BlockHash],
    lease_s: float | None,
) -> tuple[list[BlockMeta], Lease | None]:
    """The records of the held prefix of ``ids`` the peer may read and, with ``lease_s``, a
    lease on it.

    Ids are screened before the lookup, so that a lookup never touches (nor leases) a block
    of another tenant: the ids are cut at the first one held for someone else. Blocks the
    lookup itself brings in (from the shared tier) are checked after it."""
    screened: list[BlockMeta] = []
    for i, block_hash in enumerate(ids):
        verdict = _readable(node, peer, block_hash, root)
        if verdict is True:
            break
        if verdict is False:
            ids = ids[:i]
            break
        screened.append(verdict)
    if not ids:
        return [], None
    match = node.store.lookup(ids, lease_s=lease_s)
    metas = screened[: match.num_blocks]
    for i in range(len(metas), match.num_blocks):
        verdict = _readable(node, peer, match.hashes[i], root)
        if isinstance(verdict, bool):
            # Rare: a block adopted from the shared tier is not the peer's (or went away).
            # Lease only what the peer may read.
            if match.lease is not None:
                node.release(match.lease.id)
            if not i:
                return [], None
            again = node.store.lookup(match.hashes[:i], lease_s=lease_s)
            return metas[: again.num_blocks], again.lease
        metas.append(verdict)
    return metas, match.lease


def _reap(node: CacheNode, peer: Peer) -> None:
    now = node.store.clock.now()
    for key in [k for k, v in peer.leases.items() if v.expires_at <= now]:
        del peer.leases[key]


class HeldRun(NamedTuple):
    """The matched run of a LOOKUP or LOCATE: its blocks' sizes and fastest tiers."""

    nbytes: list[int]
    tiers: list[int]
    """Indices in the store's tier order."""


def leased_lookup(node: CacheNode, peer: Peer, request: Lookup) -> tuple[HeldRun, bytes | None]:
    """The longest held prefix of ``request.ids`` the peer may read and, when ``lease_ms``
    asks for one, the key of the connection's lease on it (LOOKUP, LOCATE).

    The root is one this connection resolved, so its chains are the peer's: the ids are cut
    to the run linked to that root (``CacheNode.chain_prefix``, a few record reads however
    long the run) before the store's lookup touches or leases anything."""
    _namespace_of(peer, request.root)
    lease_s = request.lease_ms / 1000 if request.lease_ms else None
    if lease_s is not None and len(peer.leases) >= MAX_LEASES:
        _reap(node, peer)
        if len(peer.leases) >= MAX_LEASES:
            raise InvalidInput(f"this connection holds {MAX_LEASES} leases: release some")
    ids = [BlockHash(h) for h in request.ids]
    if request.keyed:
        # keyed ids stand alone: the run of them held under the caller's root
        held = node.store.held_under(request.root, ids)
        own = held.index(False) if False in held else len(held)
    else:
        own = node.chain_prefix(request.root, ids)
    if not own:
        return HeldRun([], []), None
    match = node.store.lookup(ids[:own], lease_s=lease_s)
    key = None
    if match.lease is not None:
        key = secrets.token_bytes(16)
        lease = match.lease
        peer.leases[key] = PeerLease(lease.id, list(lease.hashes), lease.expires_at)
    order = {name: i for i, name in enumerate(node.store.tier_names())}
    first = node.store.meta(match.hashes[0]) if match.hashes else None
    size = first.nbytes if first is not None else 0  # one payload size per namespace root
    return HeldRun([size] * match.num_blocks, [order[t] for t in match.tiers]), key


def lookup(node: CacheNode, peer: Peer, request: Lookup) -> LookupOk:
    """The longest held prefix of ``request.ids`` the peer may read, leased on request."""
    held, key = leased_lookup(node, peer, request)
    return LookupOk(key, request.lease_ms if key is not None else 0, held.nbytes, held.tiers)


def exists(node: CacheNode, peer: Peer, request: Exists) -> list[bool]:
    """Which of ``request.ids`` the node holds under the root, each on its own (EXISTS).

    The root is one this connection resolved, so a block under it is the peer's. Blocks only
    in the fleet's shared tier are not asked for (a LOOKUP adopts them)."""
    _namespace_of(peer, request.root)
    return node.store.held_under(request.root, [BlockHash(h) for h in request.ids])


def release(node: CacheNode, peer: Peer, key: bytes) -> None:
    lease = peer.leases.pop(key, None)
    if lease is None:
        raise LeaseNotFound(f"no lease {key.hex()} on this connection")
    node.release(lease.store_id)


def release_checked(node: CacheNode, peer: Peer, key: bytes) -> bool:
    """Release a lease of this connection; whether it was still live, that is whether its
    blocks stayed pinned from the lookup until now (False for an unknown, released or expired
    lease: never an error)."""
    try:
        release(node, peer, key)
    except LeaseNotFound:
        return False
    return True


def drop_peer(node: CacheNode, peer: Peer) -> int:
    """Release every lease the connection still holds (it is gone); returns how many were
    live."""
    released = 0
    for lease in peer.leases.values():
        try:
            node.release(lease.store_id)
            released += 1
        except LeaseNotFound:
            pass  # expired, or released through the REST API
    peer.leases.clear()
    return released


# -- LOAD --------------------------------------------------------------------------------------


@dataclass(slots=True)
class LoadPlan:
    """What a LOAD sends: ``hashes`` (None: a block reported missing; then ``missing`` more),
    each before ``expires_at``; ``release`` is the store lease to release afterwards."""

    hashes: list[BlockHash | None]
    missing: int
    expires_at: float
    release: str | None = None
    key: bytes | None = None


def plan_load(
    node: CacheNode, peer: Peer, request: LoadLease | LoadIds, *, lease_s: float
) -> LoadPlan:
    """Blocks of a lease of this connection, or the held prefix of a list of ids leased for
    ``lease_s`` (released by ``finish_load``)."""
    if isinstance(request, LoadLease):
        lease = peer.leases.get(request.lease)
        if lease is None or lease.expires_at <= node.store.clock.now():
            peer.leases.pop(request.lease, None)
            raise LeaseNotFound(
                f"no live lease {request.lease.hex()} on this connection (released or expired)"
            )
        end = request.start + request.blocks
        if end > len(lease.hashes):
            raise InvalidInput(
                f"blocks {request.start}..{end} asked of a lease on {len(lease.hashes)} blocks"
            )
        return LoadPlan(
            list(lease.hashes[request.start : end]),
            0,
            lease.expires_at,
            lease.store_id if request.release else None,
            request.lease if request.release else None,
        )
    ids = [BlockHash(h) for h in request.ids]
    if request.each:
        return _plan_each(node, peer, ids, lease_s)
    metas, held = _leased_run(node, peer, None, ids, lease_s)
    return LoadPlan(
        [m.block_hash for m in metas],
        len(ids) - len(metas),
        held.expires_at if held is not None else 0.0,
        held.id if held is not None else None,
    )


def _plan_each(node: CacheNode, peer: Peer, ids: list[BlockHash], lease_s: float) -> LoadPlan:
    """A LOAD of every id on its own (``F_LOAD_EACH``): the ids the peer may read that are
    held are leased together while they are sent; the others answer missing."""
    readable = [isinstance(_readable(node, peer, h, None), BlockMeta) for h in ids]
    wanted = [h for h, ok in zip(ids, readable, strict=True) if ok]
    match = node.store.lookup(wanted, lease_s=lease_s) if wanted else None
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


LEASE_MARGIN_S = 0.05
"""A block is not sent on a lease with less left than this."""


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
        return as_memoryview(node.store.get(block_hash)), left
    except BlockNotFound:
        return None, left


def finish_load(node: CacheNode, peer: Peer, plan: LoadPlan) -> None:
    if plan.key is not None:
        peer.leases.pop(plan.key, None)
    if plan.release is not None:
        with contextlib.suppress(LeaseNotFound):
            node.release(plan.release)


# -- STORE -------------------------------------------------------------------------------------


@dataclass(slots=True)
class StorePlan:
    head: StoreHead
    ids: list[BlockHash]
    ttl_s: float | None
    durable: bool
    parents: list[BlockHash | None]
    """Each block's parent: the previous block in a chain segment (``parent`` for block 0)."""
    status: list[int] = field(default_factory=list)


def plan_store(node: CacheNode, peer: Peer, head: StoreHead, token_bytes: bytes) -> StorePlan:
    """Check a STORE's root and parent and derive its ids (before any payload is read)."""
    namespace = _namespace_of(peer, head.root)
    if head.keyed:
        pass  # the token section holds keys (``frames`` checked its word count)
    elif head.block_tokens != namespace.block_tokens:
        raise InvalidInput(
            f"STORE of {head.block_tokens}-token blocks in a namespace of "
            f"{namespace.block_tokens}-token blocks"
        )
    if head.parent is not None:
        meta = node.owned_meta(peer.tenant, BlockHash(head.parent))
        if meta is None or not meta.tiers or meta.namespace_root != head.root:
            raise StoreRefused(
                f"parent {head.parent.hex()} is not held under root {head.root.hex()}: "
                "LOOKUP the chain first, or store from an earlier block"
            )
    seed = node.settings.hash_seed
    parent = BlockHash(head.parent) if head.parent is not None else None
    if head.keyed:
        keys = [token_bytes[i : i + HASH_BYTES] for i in range(0, len(token_bytes), HASH_BYTES)]
        ids = keyed_block_ids(head.root, keys, seed)
    else:
        start = head.parent if head.parent is not None else head.root
        ids = block_hashes_from_bytes(start, token_bytes, head.block_tokens, seed)
    if head.linked:
        parents: list[BlockHash | None] = [parent, *ids[:-1]]
    else:
        parents = [parent, *[None] * (len(ids) - 1)]
    ttl_s = head.ttl_ms / 1000 if head.ttl_ms else None
    return StorePlan(head, ids, ttl_s, node.durable_uploads, parents)


def store_block(node: CacheNode, plan: StorePlan, index: int, payload: Payload) -> int:
    """Store block ``index`` of the plan (its whole payload received); returns its status.
    After a dropped block the rest of the segment is dropped unread (it would hang off it)."""
    if plan.status and plan.status[-1] == DROPPED:
        plan.status.append(DROPPED)
        return DROPPED
    result = node.store.put(
        [plan.ids[index]],
        [payload],
        namespace_root=plan.head.root,
        parent=plan.parents[index],
        ttl_s=plan.ttl_s,
        durable=plan.durable,
    )
    status = STORED if result.stored else PRESENT if result.present else DROPPED
    plan.status.append(status)
    return status
