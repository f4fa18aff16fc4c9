"""The block index: what the store knows of every block, apart from where the bytes are copied.

* Block records (``BlockMeta``, one per block, made by ``new_record`` only) and chain links
  (each record's ``kids``; the children of a parent without a record wait in ``_orphans``),
  from which each record's ``children_in`` (children held in the same tier) and
  ``children_held`` (children held in any tier) are kept.
* Per tier: how many blocks it holds and how many of its bytes are pinned.
* Pins (``ref``/``unref``: leases, sessions, moves in flight) and leases, reaped by time.
* The eviction order: every change that may make a block a victim is offered to the
  ``EvictionPolicy`` (``track``); the policy's heaps live under the same lock.
* The expiry order (``ExpiryIndex``): what ``expired_unpinned`` returns costs in proportion to
  what has expired, not to how many blocks are held.

Not locked and never doing I/O: its one owner, the ``TieredStore``, calls it with the store's
lock held, and does every tier call and observer notification itself (see ``store.py``).
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable, Iterator, Sequence, ValuesView
from dataclasses import dataclass

from sessioncache.blocks import BlockMeta, Kids, bumped, counts
from sessioncache.expiry import ExpiryIndex
from sessioncache.hashing import BlockHash
from sessioncache.policy import EvictionPolicy
from sessioncache.tiers.base import LocatedBlock, RecoveredBlock


@dataclass(frozen=True, slots=True)
class Lease:
    """A pin on a matched prefix, released by ``TieredStore.release`` or at ``expires_at``."""

    id: str
    hashes: tuple[BlockHash, ...]
    expires_at: float


class BlockIndex:
    """Block records, chain links, per-tier counts, pins and leases (see the module doc)."""

    def __init__(self, num_tiers: int, policy: EvictionPolicy) -> None:
        self._num_tiers = num_tiers
        self._policy = policy
        self._blocks: dict[BlockHash, BlockMeta] = {}
        # The children of ids that have no record (forgotten while their children were held).
        self._orphans: dict[BlockHash, Kids] = {}
        self._expiry: ExpiryIndex[BlockHash] = ExpiryIndex()
        self._zeros = counts([0] * num_tiers)
        # The expiry last computed by ``new_record``: blocks stored together share the float.
        self._last_expiry: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self._leases: dict[str, Lease] = {}
        self.tier_blocks = [0] * num_tiers
        """Blocks held per tier."""
        self.pinned_bytes = [0] * num_tiers
        """Bytes of pinned blocks per tier."""
        self._seq = itertools.count(1)  # one per block touch: orders a chain's blocks
        self._ops = itertools.count(1)  # one per operation: orders same-instant touches
        # The record of an id, or None: the dict's own bound method (the policy calls it for
        # every heap entry it pops).
        self.get: Callable[[BlockHash], BlockMeta | None] = self._blocks.get
        policy.bind(self._blocks.get)

    # -- records ------------------------------------------------------------------------

    def records(self) -> ValuesView[BlockMeta]:
        return self._blocks.values()

    def new_record(
        self,
        block_hash: BlockHash,
        *,
        parent: BlockHash | None,
        namespace_root: bytes,
        nbytes: int,
        ttl_s: float,
        created: float,
        last_access: float | None = None,
        expires_at: float | None = None,
        ref_cnt: int = 0,
        touched_by_op: int = 0,
    ) -> BlockMeta:
        """Make and index the record of a block not in the index (held in no tier yet). Unless
        told otherwise it was last accessed when ``created`` and expires ``ttl_s`` after that
        last access."""
        if last_access is None:
            last_access = created
        if expires_at is None:
            at, ttl, value = self._last_expiry
            if at == last_access and ttl == ttl_s:
                expires_at = value
            else:
                expires_at = last_access + ttl_s
                self._last_expiry = (last_access, ttl_s, expires_at)
        kids = self._orphans.pop(block_hash, None)
        meta = BlockMeta(
            block_hash=block_hash,
            parent=parent,
            namespace_root=namespace_root,
            nbytes=nbytes,
            ttl_s=ttl_s,
            created=created,
            last_access=last_access,
            expires_at=expires_at,
            children_in=self._zeros,
            # Children still held: a record made anew (its old one was forgotten while they
            # were held) must count them, or ``children_held`` goes negative.
            children_held=0
            if kids is None
            else sum(1 for kid in _each(kids) if self._blocks[kid].mask),
            ref_cnt=ref_cnt,
            touched_by_op=touched_by_op,
            touch_order=next(self._seq),
        )
        meta.kids = kids
        self._blocks[block_hash] = meta
        self._expiry.add(block_hash, expires_at)
        if parent is not None:
            owner = self._blocks.get(parent)
            if owner is not None:
                owner.kids = _with(owner.kids, block_hash)
            else:
                self._orphans[parent] = _with(self._orphans.get(parent), block_hash)
        return meta

    def forget(self, meta: BlockMeta) -> None:
        """Drop ``meta``'s record (held nowhere, unpinned) and its link to its parent."""
        if self._blocks.get(meta.block_hash) is not meta:
            return
        del self._blocks[meta.block_hash]
        if meta.kids is not None:
            self._orphans[meta.block_hash] = meta.kids
        if meta.parent is not None:
            owner = self._blocks.get(meta.parent)
            if owner is not None:
                owner.kids = _without(owner.kids, meta.block_hash)
            else:
                kids = _without(self._orphans.get(meta.parent), meta.block_hash)
                if kids is None:
                    self._orphans.pop(meta.parent, None)
                else:
                    self._orphans[meta.parent] = kids

    def snapshot(self, block_hash: BlockHash) -> BlockMeta | None:
        """A copy of the record of ``block_hash``, or None."""
        meta = self._blocks.get(block_hash)
        if meta is None:
            return None
        return meta.copy()

    def held(self, block_hash: BlockHash, now: float) -> BlockMeta | None:
        """The record of ``block_hash`` if a tier holds it unexpired."""
        meta = self._blocks.get(block_hash)
        if meta is None or not meta.mask or meta.expires_at <= now:
            return None
        return meta

    def held_prefix(self, hashes: Sequence[BlockHash], now: float) -> list[BlockMeta]:
        """The records of the held, unexpired run of ``hashes`` from its start."""
        run: list[BlockMeta] = []
        blocks = self._blocks
        get = blocks.get
        append = run.append
        for block_hash in hashes:
            meta = get(block_hash)
            if meta is None or not meta.mask or meta.expires_at <= now:
                break
            append(meta)
        return run

    def chain_to(self, head: BlockHash) -> list[BlockHash]:
        """The held chain ending at ``head``, root first (empty when ``head`` is not held)."""
        chain: list[BlockHash] = []
        cursor: BlockHash | None = head
        while cursor is not None:
            meta = self._blocks.get(cursor)
            if meta is None or not meta.mask:
                break
            chain.append(cursor)
            cursor = meta.parent
        chain.reverse()
        return chain

    def parent_tier(self, meta: BlockMeta) -> int:
        """The fastest tier holding ``meta``'s parent (0 for a root, or a parent not held)."""
        parent = self._blocks.get(meta.parent) if meta.parent is not None else None
        return min(parent.tiers) if parent is not None and parent.tiers else 0

    def held_count(self) -> int:
        return sum(1 for m in self._blocks.values() if m.mask)

    def pinned_count(self) -> int:
        return sum(1 for m in self._blocks.values() if m.ref_cnt)

    def expired_unpinned(self, now: float) -> list[BlockMeta]:
        """The unpinned records expired at ``now``: from the expiry index, at a cost in
        proportion to the records due (expired, or touched since they were filed)."""
        return self._expiry.due(now, self._due)

    def _due(self, block_hash: BlockHash, now: float) -> tuple[BlockMeta | None, float | None]:
        """For ``ExpiryIndex.due``: the record if it is an unpinned expired one; else when to
        ask again (its expiry, or ``now`` for a pinned one: next sweep), or None (forgotten)."""
        meta = self._blocks.get(block_hash)
        if meta is None:
            return None, None
        if meta.expires_at > now:
            return None, meta.expires_at
        if meta.ref_cnt:
            return None, now
        return meta, None

    # -- touches ------------------------------------------------------------------------

    def next_op(self) -> int:
        """A new operation number (blocks touched by one operation share it)."""
        return next(self._ops)

    def touch_chain(
        self, metas: Sequence[BlockMeta], now: float, ttl: float | None, *, hit: bool = True
    ) -> None:
        """``touch`` of each of ``metas`` (root first) in one operation, inlined for speed;
        ``hit``: a lookup's match, counted in each block's ``hit_count``."""
        op = next(self._ops)
        seq = self._seq
        hits = 1 if hit else 0
        last_ttl = -1.0
        expires = 0.0
        for meta in metas:
            meta.hit_count += hits
            if ttl is not None and ttl > meta.ttl_s:
                meta.ttl_s = ttl
            meta.last_access = now
            meta.touched_by_op = op
            if meta.ttl_s != last_ttl:  # one float for the blocks of one TTL
                last_ttl = meta.ttl_s
                expires = now + last_ttl
            if expires > meta.expires_at:
                meta.expires_at = expires
            meta.touch_order = next(seq)

    def touch(self, meta: BlockMeta, now: float, ttl: float | None, op: int) -> None:
        """Slide ``meta``'s expiry (its TTL raised to at least ``ttl``) and LRU position."""
        if ttl is not None and ttl > meta.ttl_s:
            meta.ttl_s = ttl
        meta.last_access = now
        meta.touched_by_op = op
        meta.expires_at = max(meta.expires_at, now + meta.ttl_s)
        meta.touch_order = next(self._seq)

    # -- copies -------------------------------------------------------------------------

    def add_copy(self, meta: BlockMeta, tier: int) -> bool:
        """``tier`` now holds ``meta``'s payload; False when it already did."""
        bit = 1 << tier
        if meta.mask & bit:
            return False
        if not meta.mask:
            self._children_held_changed(meta, +1)
        meta.mask |= bit
        self.tier_blocks[tier] += 1
        if meta.ref_cnt:
            self.pinned_bytes[tier] += meta.nbytes
        if meta.kids is not None:
            held_here = sum(1 for kid in _each(meta.kids) if self._blocks[kid].mask & bit)
            if held_here != meta.children_in[tier]:
                meta.children_in = bumped(
                    meta.children_in, tier, held_here - meta.children_in[tier]
                )
        elif meta.children_in[tier]:
            meta.children_in = bumped(meta.children_in, tier, -meta.children_in[tier])
        parent = self._blocks.get(meta.parent) if meta.parent is not None else None
        if parent is not None and parent.mask & bit:
            parent.children_in = bumped(parent.children_in, tier, +1)
        for held in meta.tiers:
            self._policy.track(meta, held)  # ``tier``, and the copies below it, now spare
        return True

    def remove_copy(self, meta: BlockMeta, tier: int) -> bool:
        """``tier`` no longer holds ``meta``'s payload (the record goes with its last copy
        unless pinned); False when it did not hold it."""
        bit = 1 << tier
        if not meta.mask & bit:
            return False
        meta.mask &= ~bit
        self.tier_blocks[tier] -= 1
        if meta.ref_cnt:
            self.pinned_bytes[tier] -= meta.nbytes
        parent = self._blocks.get(meta.parent) if meta.parent is not None else None
        if parent is not None and parent.mask & bit:
            parent.children_in = bumped(parent.children_in, tier, -1)
            self._policy.track(parent, tier)
        if not meta.mask:
            self._children_held_changed(meta, -1)
            if not meta.ref_cnt:
                self.forget(meta)
        return True

    def _children_held_changed(self, meta: BlockMeta, delta: int) -> None:
        """``meta`` gained its first or lost its last copy: its parent's ``children_held``."""
        parent = self._blocks.get(meta.parent) if meta.parent is not None else None
        if parent is None:
            return
        parent.children_held += delta
        if parent.children_held == 0:
            for tier in parent.tiers:
                self._policy.track(parent, tier)

    # -- adoption: blocks a tier holds that this index did not make --------------------

    def adopt_located(
        self, block_hash: BlockHash, remote: LocatedBlock, now: float, default_ttl: float
    ) -> BlockMeta:
        """The record of a block the fleet's shared tier holds unexpired (``remote``), made
        or with its expiry raised to the shared one; the caller adds the copy."""
        assert remote.expires_at is not None
        meta = self._blocks.get(block_hash)
        if meta is None:
            return self.new_record(
                block_hash,
                parent=remote.parent,
                namespace_root=remote.namespace_root,
                nbytes=remote.nbytes,
                ttl_s=max(default_ttl, remote.expires_at - now),
                created=now,
                expires_at=remote.expires_at,
            )
        meta.expires_at = max(meta.expires_at, remote.expires_at)
        return meta

    def adopt_recovered(
        self, found: RecoveredBlock, tier: int, now: float, default_ttl: float
    ) -> None:
        """Index a block a durable tier found on start; ``relink`` once all are in."""
        meta = self._blocks.get(found.block_hash)
        if meta is None:
            meta = self.new_record(
                found.block_hash,
                parent=found.parent,
                namespace_root=found.namespace_root,
                nbytes=found.nbytes,
                ttl_s=found.ttl_s if found.ttl_s is not None else default_ttl,
                created=found.mtime,
                last_access=min(found.mtime, now),
                expires_at=found.expires_at,
            )
        if not meta.mask >> tier & 1:
            meta.mask |= 1 << tier
            self.tier_blocks[tier] += 1

    def relink(self) -> None:
        """After ``adopt_recovered``: count each record's held children, per tier and in
        all, and build the eviction order of every tier."""
        zeros, blocks = self._zeros, self._blocks
        for meta in blocks.values():
            meta.children_held = 0
            if meta.kids is None:  # most blocks: a chain's tail, or a single child
                meta.children_in = zeros
                continue
            children_in = [0] * self._num_tiers
            for kid_hash in _each(meta.kids):
                kid = blocks[kid_hash]
                if kid.mask:
                    meta.children_held += 1
                both = kid.mask & meta.mask
                for index in range(both.bit_length()):
                    if both >> index & 1:
                        children_in[index] += 1
            meta.children_in = counts(children_in)
        for index in range(self._num_tiers):
            self._policy.rebuild(index, (m for m in self._blocks.values() if m.mask >> index & 1))

    # -- pins and leases ----------------------------------------------------------------

    def ref(self, meta: BlockMeta) -> None:
        if meta.ref_cnt == 0:
            for tier in meta.tiers:
                self.pinned_bytes[tier] += meta.nbytes
        meta.ref_cnt += 1

    def unref(self, meta: BlockMeta) -> None:
        if meta.ref_cnt <= 0:
            return
        meta.ref_cnt -= 1
        if meta.ref_cnt == 0:
            for tier in meta.tiers:
                self.pinned_bytes[tier] -= meta.nbytes
                self._policy.track(meta, tier)
        elif meta.ref_cnt == meta.pins and len(meta.tiers) > 1:
            for tier in meta.tiers:
                self._policy.track(meta, tier)  # only session pins left: copies are spare

    def unref_all(self, hashes: Sequence[BlockHash]) -> None:
        for block_hash in hashes:
            meta = self._blocks.get(block_hash)
            if meta is not None:
                self.unref(meta)

    def pin(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """A session pin on the longest held prefix of ``hashes``; returns the pinned ids."""
        pinned: list[BlockHash] = []
        for block_hash in hashes:
            meta = self._blocks.get(block_hash)
            if meta is None or not meta.mask:
                break
            meta.pins += 1
            self.ref(meta)
            pinned.append(block_hash)
        return pinned

    def unpin(self, hashes: Sequence[BlockHash]) -> None:
        """Undo ``pin`` for the same ids."""
        for block_hash in hashes:
            meta = self._blocks.get(block_hash)
            if meta is not None and meta.pins:
                meta.pins -= 1
        self.unref_all(hashes)

    def lease(self, metas: Sequence[BlockMeta], expires_at: float) -> Lease:
        """Pin ``metas`` until ``release`` or ``expires_at``."""
        lease = Lease(secrets.token_hex(16), tuple(m.block_hash for m in metas), expires_at)
        for meta in metas:
            self.ref(meta)
        self._leases[lease.id] = lease
        return lease

    def release(self, lease_id: str, now: float) -> bool:
        """Unpin a lease's blocks; False when it is unknown or already over: released, reaped,
        or past its expiry at ``now`` though not reaped yet (then it is released now). True
        therefore means that its blocks stayed pinned from the lookup until now."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self.unref_all(lease.hashes)
        return lease.expires_at > now

    def reap_leases(self, now: float) -> None:
        """Release the leases over at ``now``."""
        if not self._leases:
            return
        for lease_id in [k for k, v in self._leases.items() if v.expires_at <= now]:
            self.unref_all(self._leases.pop(lease_id).hashes)

    def find_lease(self, lease_id: str) -> Lease | None:
        """The live or not yet reaped lease of that id."""
        return self._leases.get(lease_id)

    def lease_count(self) -> int:
        return len(self._leases)


def _each(kids: Kids) -> Iterator[BlockHash]:
    """The ids in a ``kids`` field."""
    if kids is None:
        return
    if isinstance(kids, bytes):
        yield kids
    else:
        yield from kids


def _with(kids: Kids, kid: BlockHash) -> Kids:
    """``kids`` and ``kid``: one id stays inline; a second makes a set."""
    if kids is None or kids == kid:
        return kid
    if isinstance(kids, bytes):
        return {kids, kid}
    kids.add(kid)
    return kids


def _without(kids: Kids, kid: BlockHash) -> Kids:
    if kids is None or isinstance(kids, bytes):
        return None if kids == kid else kids
    kids.discard(kid)
    if len(kids) == 1:
        return next(iter(kids))
    return kids or None
