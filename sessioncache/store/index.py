"""The block index: what the store knows of every block, apart from where the bytes are copied.

* Block records (a slot each in a ``BlockTable``, made by ``new_record`` only, read through
  ``BlockMeta`` handles) and chain links (each slot's kid list; the children of a parent
  without a record wait in ``_orphans``), from which each record's ``children_in`` (children
  held in the same tier) and ``children_held`` (children held in any tier) are kept.
* The lookup of a chain (``held_run``, ``touch_run``): whole runs of slots at once.
* Per tier: how many blocks it holds and how many of its bytes are pinned.
* Pins (``ref``/``unref``: leases, sessions, moves in flight) and leases, reaped by time.
* The eviction order: every change that may make a block a victim is offered to the
  ``EvictionPolicy`` (``track``); the policy's heaps live under the same lock, and which block
  may leave a tier, in which order, is the policy's (``store.eviction``).
* The expiry order (``ExpiryIndex``): what ``expired_unpinned`` returns costs in proportion to
  what has expired, not to how many blocks are held.

Not locked and never doing I/O: its one owner, the ``TieredStore``, calls it with the store's
lock held, and does every tier call and observer notification itself (see ``store.py``).
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sessioncache.hashing import HASH_BYTES, BlockHash
from sessioncache.store.adoption import IndexAdoption
from sessioncache.store.blocks import BlockMeta, tier_set
from sessioncache.store.events import Touched
from sessioncache.store.eviction import EvictionPolicy, may_leave
from sessioncache.store.expiry import ExpiryIndex
from sessioncache.store.forecast import NO_FORECAST, ORPHAN_BASE
from sessioncache.store.table import F_PARENT, NO_SLOT, BlockFields, BlockTable

Slots = npt.NDArray[np.int64]
"""Slots of the ``BlockTable``, in chain order."""


class Run:
    """The slots of a matched run of blocks, in chain order (``BlockIndex.held_run``)."""

    __slots__ = ("at", "slots")

    def __init__(self, slots: Slots, at: Slots | slice | None = None) -> None:
        self.slots = slots
        self.at: Slots | slice = slots if at is None else at
        """What indexes the table's columns: a slice when the slots are consecutive (the
        blocks of one put: most runs), cheaper than gathering by the slot array."""

    def __len__(self) -> int:
        return len(self.slots)

    @classmethod
    def one(cls, slot: int) -> Run:
        return cls(np.array([slot], np.int64))

    def prefix(self, n: int) -> Run:
        """The run of the first ``n`` slots."""
        at = self.at
        if isinstance(at, slice):
            return Run(self.slots[:n], slice(at.start, at.start + n))
        return Run(self.slots[:n])


_NO_SLOTS: Slots = np.empty(0, np.int64)
_NO_RUN = Run(_NO_SLOTS)
# A lookup compares the blocks of one put (consecutive slots) at once; after this many runs
# of them the rest of a (scattered) chain is found id by id.
_MAX_RUNS = 16


@dataclass(frozen=True, slots=True)
class Lease:
    """A pin on a matched prefix, released by ``TieredStore.release`` or at ``expires_at``."""

    id: str
    hashes: tuple[BlockHash, ...]
    expires_at: float


class BlockIndex:
    """Block records, chain links, per-tier counts, pins and leases (see the module doc)."""

    def __init__(self, num_tiers: int, policy: EvictionPolicy, *, slots_tier: int = -1) -> None:
        """``slots_tier``: the tier whose slots a lease hands out (``BlockTable.slots_tier``)."""
        self._num_tiers = num_tiers
        self._policy = policy
        self._table = BlockTable(num_tiers)
        self._table.slots_tier = slots_tier
        # The first child slot of ids that have no record (forgotten while their children
        # were held); the rest of each list through the table's kid links.
        self._orphans: dict[BlockHash, int] = {}
        self._expiry: ExpiryIndex[BlockHash] = ExpiryIndex()
        self.leases = Leases(self)
        """The leases pinning records until released or past their expiry."""
        self.adoption = IndexAdoption(self)
        """Records of blocks a tier holds that this index did not make."""
        self.tier_blocks = [0] * num_tiers
        """Blocks held per tier."""
        self.pinned_bytes = [0] * num_tiers
        """Bytes of pinned blocks per tier."""
        self.root_pinned: dict[bytes, list[int]] = {}
        """The same per namespace root: a tenant's share is its roots' sum."""
        self._in_flight: dict[int, int] = {}
        """Per slot, the references of the node's own copies (``ref(in_flight=True)``):
        they keep the block in place but are no pin, so no tenant's pin share pays them."""
        self._order = 1  # the next touch order: orders a chain's blocks
        self._ops = itertools.count(1)  # one per operation: orders same-instant touches
        policy.bind(self.get)

    # -- records ------------------------------------------------------------------------

    def get(self, block_hash: BlockHash) -> BlockMeta | None:
        """The record of an id, or None."""
        slot = self._table.slot_of.get(block_hash)
        return None if slot is None else BlockMeta.at(self._table, slot, block_hash)

    def records(self) -> list[BlockMeta]:
        table = self._table
        return [BlockMeta.at(table, slot, key) for key, slot in table.slot_of.items()]

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
        next_use: float | None = None,
    ) -> BlockMeta:
        """Make and index the record of a block not in the index (held in no tier yet). Unless
        told otherwise it was last accessed when ``created``, expires ``ttl_s`` after that
        last access, and starts with its parent's forecast."""
        if last_access is None:
            last_access = created
        if expires_at is None:
            expires_at = last_access + ttl_s
        table = self._table
        first = self._orphans.pop(block_hash, NO_SLOT)
        # Children still held: a record made anew (its old one was forgotten while they were
        # held) must count them, or ``children_held`` goes negative.
        held = 0 if first == NO_SLOT else sum(1 for k in table.kids_from(first) if table.mask[k])
        order = self._next_order(1)
        owner = table.slot_of.get(parent) if parent is not None else None
        # A block continues its parent's chain: it is read no sooner than its parent, so it
        # starts with the parent's forecast (the session's, while its chain is written).
        if next_use is None:
            next_use = NO_FORECAST if owner is None else table.nxt[owner]
            if next_use >= ORPHAN_BASE / 2:
                next_use = NO_FORECAST  # a dead branch taken up again: its writer files it
        slot = table.new(
            BlockFields(
                block_hash,
                parent,
                namespace_root,
                nbytes,
                ttl_s,
                created,
                last_access,
                expires_at,
                ref_cnt=ref_cnt,
                children_held=held,
                touched_by_op=touched_by_op,
                touch_order=order,
                next_use=next_use,
            )
        )
        table.first_kid[slot] = first
        self._expiry.add(block_hash, expires_at)
        if parent is not None:
            if owner is None:  # unknown before, or the block itself (named its own parent)
                owner = table.slot_of.get(parent)
            if owner is not None:
                table.first_kid[owner] = table.push_kid(table.first_kid[owner], slot)
            else:
                self._orphans[parent] = table.push_kid(self._orphans.get(parent, NO_SLOT), slot)
        return BlockMeta.at(table, slot, block_hash)

    def _next_order(self, n: int) -> int:
        order = self._order
        self._order = order + n
        return order

    def forget(self, meta: BlockMeta) -> None:
        """Drop ``meta``'s record (held nowhere, unpinned) and its link to its parent."""
        table, slot = self._table, meta.slot
        if not meta.live:
            return
        parent = meta.parent
        if parent is not None:  # first: a block that names itself its parent is its own kid
            owner = table.slot_of.get(parent)
            if owner is not None:
                table.first_kid[owner] = table.drop_kid(table.first_kid[owner], slot)
            else:
                head = table.drop_kid(self._orphans.get(parent, NO_SLOT), slot)
                if head == NO_SLOT:
                    self._orphans.pop(parent, None)
                else:
                    self._orphans[parent] = head
        first = table.first_kid[slot]
        if first != NO_SLOT:
            self._orphans[meta.block_hash] = first
            table.first_kid[slot] = NO_SLOT
        self._in_flight.pop(slot, None)
        table.free(slot)

    def snapshot(self, block_hash: BlockHash) -> BlockMeta | None:
        """A copy of the record of ``block_hash``, or None."""
        meta = self.get(block_hash)
        return None if meta is None else meta.copy()

    def held(self, block_hash: BlockHash, now: float) -> BlockMeta | None:
        """The record of ``block_hash`` if a tier holds it unexpired."""
        table = self._table
        slot = table.slot_of.get(block_hash)
        if slot is None or not table.mask[slot] or table.expires[slot] <= now:
            return None
        return BlockMeta.at(table, slot, block_hash)

    def held_run(self, hashes: Sequence[BlockHash], now: float) -> Run:
        """The slots of the held, unexpired run of ``hashes`` from its start.

        The blocks of one put lie in consecutive slots, so the slots of a run are guessed from
        its first block (one dict lookup) and checked by comparing the ids themselves, a run
        at a time; a cost per block in array operations, not Python steps."""
        table = self._table
        n = len(hashes)
        slot_of = table.slot_of
        first = slot_of.get(hashes[0]) if n else None
        if first is None:
            return _NO_RUN
        if n == 1:
            if not table.mask[first] or table.expires[first] <= now:
                return _NO_RUN
            return Run.one(first)
        joined = b"".join(hashes)
        id_bytes, width = table.id_bytes, HASH_BYTES
        mask, expires = table.column("mask"), table.column("expires")
        size = len(mask)
        slots: Slots = np.empty(n, np.int64)
        pos, slot, runs = 0, first, 0
        while True:
            m = min(n - pos, size - slot)
            at, start = slot * width, pos * width
            if bytes(id_bytes[at : at + m * width]) == joined[start : start + m * width]:
                run = m  # one compare of the whole guess: the usual case
            else:  # the guess stops at the first id that differs
                ids = table.id_view()[slot : slot + m]
                query = np.frombuffer(joined, np.uint64, 2 * m, start).reshape(m, 2)
                run = int((ids == query).all(axis=1).argmin())
            held = (mask[slot : slot + run] != 0) & (expires[slot : slot + run] > now)
            stopped = not held.all()
            if stopped:
                run = int(held.argmin())
            slots[pos : pos + run] = np.arange(slot, slot + run)
            pos += run
            runs += 1
            if pos == n:
                break
            found = slot_of.get(hashes[pos])
            if found is None or (stopped and found == slot + run):
                break  # not held, or its own record is not (a freed slot keeps its old id)
            if runs == _MAX_RUNS:  # scattered: the rest id by id
                while table.mask[found] and table.expires[found] > now:
                    slots[pos] = found
                    pos += 1
                    if pos == n or (found := slot_of.get(hashes[pos])) is None:
                        break
                break
            slot = found
        if runs == 1:
            return Run(slots[:pos], slice(first, first + pos))
        return Run(slots[:pos])

    def metas(self, run: Run, hashes: Sequence[BlockHash]) -> list[BlockMeta]:
        """The records of ``run``, the slots of ``hashes[:len(run)]``."""
        table = self._table
        slots = run.slots.tolist()
        return [BlockMeta.at(table, s, h) for s, h in zip(slots, hashes, strict=False)]

    def touched(self, run: Run, hashes: Sequence[BlockHash]) -> Touched:
        """What observers hear of a touch of ``run``, the slots of ``hashes[:len(run)]``."""
        col, at = self._table.column, run.at
        return Touched(
            hashes[: len(run)],
            col("mask")[at].tolist(),
            col("last")[at].tolist(),
            col("expires")[at].tolist(),
            col("hits")[at].tolist(),
            col("ref")[at].tolist(),
            col("ttl")[at].tolist(),
        )

    def names(self, run: Run, name_of_mask: Sequence[str]) -> list[str]:
        """``name_of_mask[mask]`` of each of ``run``'s tier masks."""
        masks = self._table.column("mask")[run.at]
        if not len(masks):
            return []
        first = int(masks[0])
        if (masks == first).all():  # one tier holds the whole run: the usual case
            return [name_of_mask[first]] * len(masks)
        return [name_of_mask[mask] for mask in masks.tolist()]

    def chain_to(self, head: BlockHash) -> list[BlockHash]:
        """The held chain ending at ``head``, root first (empty when ``head`` is not held)."""
        table = self._table
        chain: list[BlockHash] = []
        cursor: BlockHash | None = head
        while cursor is not None:
            slot = table.slot_of.get(cursor)
            if slot is None or not table.mask[slot]:
                break
            chain.append(cursor)
            cursor = table.parents[slot] if table.flags[slot] & F_PARENT else None
        chain.reverse()
        return chain

    def parent_tier(self, meta: BlockMeta) -> int:
        """The fastest tier holding ``meta``'s parent (0 for a root, or a parent not held)."""
        parent = meta.parent
        slot = self._table.slot_of.get(parent) if parent is not None else None
        if slot is None:
            return 0
        mask = self._table.mask[slot]
        return (mask & -mask).bit_length() - 1 if mask else 0

    def held_columns(
        self,
    ) -> tuple[list[bytes], npt.NDArray[np.uint32], npt.NDArray[np.int64]]:
        """The namespace roots by number, and copies of the root numbers and payload sizes of
        the records a tier holds."""
        col = self._table.column
        held = np.flatnonzero(col("mask"))
        return list(self._table.root_list), col("root")[held], col("nbytes")[held]

    def held_count(self) -> int:
        return int(np.count_nonzero(self._table.column("mask")))

    def pinned_count(self) -> int:
        return int(np.count_nonzero(self._table.column("ref")))

    def expired_unpinned(self, now: float) -> list[BlockMeta]:
        """The unpinned records expired at ``now``: from the expiry index, at a cost in
        proportion to the records due (expired, or touched since they were filed)."""
        return self._expiry.due(now, self._due)

    def _due(self, block_hash: BlockHash, now: float) -> tuple[BlockMeta | None, float | None]:
        """For ``ExpiryIndex.due``: the record if it is an unpinned expired one; else when to
        ask again (its expiry, or ``now`` for a pinned one: next sweep), or None (forgotten)."""
        table = self._table
        slot = table.slot_of.get(block_hash)
        if slot is None:
            return None, None
        expires = table.expires[slot]
        if expires > now:
            return None, expires
        if table.ref[slot]:
            return None, now
        return BlockMeta.at(table, slot, block_hash), None

    # -- touches ------------------------------------------------------------------------

    def next_op(self) -> int:
        """A new operation number (blocks touched by one operation share it)."""
        return next(self._ops)

    def touch_run(self, run: Run, now: float, ttl: float | None, *, hit: bool = True) -> None:
        """``touch`` of each block of ``run`` (root first) in one operation, a field at a
        time; ``hit``: a lookup's match, counted in each block's ``hit_count``."""
        n = len(run)
        if not n:
            return
        col, at = self._table.column, run.at
        op = next(self._ops)
        if hit:
            if isinstance(at, slice):
                col("hits")[at] += 1
            else:  # ids may repeat in one lookup (keyed blocks): each counts
                np.add.at(col("hits"), at, 1)
        ttls = col("ttl")
        if ttl is not None:
            ttls[at] = np.maximum(ttls[at], ttl)
        col("last")[at] = now
        col("nxt")[at] = NO_FORECAST
        col("op")[at] = op
        expires = col("expires")
        expires[at] = np.maximum(expires[at], now + ttls[at])
        col("order")[at] = np.arange(self._next_order(n), self._order)

    def touch(self, meta: BlockMeta, now: float, ttl: float | None, op: int) -> None:
        """Slide ``meta``'s expiry (its TTL raised to at least ``ttl``) and LRU position."""
        table, slot = self._table, meta.slot
        if not meta.live:
            return  # a handle past its record's end (``BlockMeta.live``)
        if ttl is not None and ttl > table.ttl[slot]:
            table.ttl[slot] = ttl
        table.last[slot] = now
        table.nxt[slot] = NO_FORECAST
        table.op[slot] = op
        table.expires[slot] = max(table.expires[slot], now + table.ttl[slot])
        table.order[slot] = self._next_order(1)

    # -- copies -------------------------------------------------------------------------

    def add_copy(self, meta: BlockMeta, tier: int) -> bool:
        """``tier`` now holds ``meta``'s payload; False when it already did (or the record is
        gone: ``BlockMeta.live``)."""
        table, slot = self._table, meta.slot
        if not meta.live:
            return False
        bit = 1 << tier
        mask = table.mask[slot]
        if mask & bit:
            return False
        if not mask:
            self._children_held_changed(meta, +1)
        mask |= bit
        table.mask[slot] = mask
        self.tier_blocks[tier] += 1
        if table.ref[slot] > self._in_flight.get(slot, 0):
            _pinned(self, slot, tier, table.nbytes[slot])
        table.children_in[slot * self._num_tiers + tier] = sum(
            1 for kid in table.kids(slot) if table.mask[kid] & bit
        )
        parent = meta.parent
        owner = table.slot_of.get(parent) if parent is not None else None
        if owner is not None and table.mask[owner] & bit:
            table.children_in[owner * self._num_tiers + tier] += 1
        if may_leave(table.ref[slot], table.pins[slot] + table.leased[slot]):
            # else no copy of it is a candidate
            for held in tier_set(mask):
                self._policy.track(meta, held)  # ``tier``, and the copies below it, now spare
        return True

    def remove_copy(self, meta: BlockMeta, tier: int) -> bool:
        """``tier`` no longer holds ``meta``'s payload (the record goes with its last copy
        unless pinned); False when it did not hold it (or the record is gone)."""
        table, slot = self._table, meta.slot
        if not meta.live:
            return False
        bit = 1 << tier
        mask = table.mask[slot]
        if not mask & bit:
            return False
        mask &= ~bit
        table.mask[slot] = mask
        self.tier_blocks[tier] -= 1
        if table.ref[slot] > self._in_flight.get(slot, 0):
            _pinned(self, slot, tier, -table.nbytes[slot])
        parent = meta.parent
        owner = table.slot_of.get(parent) if parent is not None else None
        if owner is not None and table.mask[owner] & bit:
            assert parent is not None
            table.children_in[owner * self._num_tiers + tier] -= 1
            self._policy.track(BlockMeta.at(table, owner, parent), tier)
        if not mask:
            self._children_held_changed(meta, -1)
            if not table.ref[slot]:
                self.forget(meta)
        return True

    def _children_held_changed(self, meta: BlockMeta, delta: int) -> None:
        """``meta`` gained its first or lost its last copy: its parent's ``children_held``."""
        parent = meta.parent
        if parent is None:
            return
        table = self._table
        owner = table.slot_of.get(parent)
        if owner is None:
            return
        table.held[owner] += delta
        if table.held[owner] == 0:
            record = BlockMeta.at(table, owner, parent)
            for tier in tier_set(table.mask[owner]):
                self._policy.track(record, tier)

    # -- pins and leases ----------------------------------------------------------------

    def ref(self, meta: BlockMeta, *, in_flight: bool = False) -> None:
        """One more reference on ``meta``: a pin (a lease, a session, a write), or with
        ``in_flight`` a copy the node itself makes (to a lower tier, to the durable tier),
        which keeps the block where it is but is counted in no pinned bytes."""
        table, slot = self._table, meta.slot
        if not meta.live:
            return
        flying = self._in_flight.get(slot, 0)
        if in_flight:
            self._in_flight[slot] = flying + 1
        elif table.ref[slot] == flying:
            for tier in tier_set(table.mask[slot]):
                _pinned(self, slot, tier, table.nbytes[slot])
        table.ref[slot] += 1

    def unref(self, meta: BlockMeta, *, in_flight: bool = False) -> None:
        """Drop a reference ``ref`` took, with the same ``in_flight``."""
        table, slot = self._table, meta.slot
        if not meta.live:
            return
        ref = table.ref[slot]
        if ref <= 0:
            return
        flying = self._in_flight.get(slot, 0)
        if in_flight and flying:
            flying -= 1
            if flying:
                self._in_flight[slot] = flying
            else:
                del self._in_flight[slot]
        ref -= 1
        table.ref[slot] = ref
        tiers = tier_set(table.mask[slot])
        if not in_flight and ref == flying:
            for tier in tiers:
                _pinned(self, slot, tier, -table.nbytes[slot])
        if ref == 0:
            for tier in tiers:
                self._policy.track(meta, tier)
        elif may_leave(ref, table.pins[slot] + table.leased[slot]) and len(tiers) > 1:
            for tier in tiers:
                self._policy.track(meta, tier)  # only pins and leases left: copies are spare

    def unref_all(self, hashes: Sequence[BlockHash]) -> None:
        for block_hash in hashes:
            meta = self.get(block_hash)
            if meta is not None:
                self.unref(meta)

    def pin(
        self, hashes: Sequence[BlockHash], admit: Callable[[Run], int] | None = None
    ) -> list[BlockHash]:
        """A session pin on the longest prefix of ``hashes`` a tier holds (blocks past a hole
        are useless), of it the first ``admit(run)`` blocks only where given (a budget's, by
        ``pin_sizes``); returns the pinned ids."""
        table = self._table
        slots: list[int] = []
        for block_hash in hashes:
            slot = table.slot_of.get(block_hash)
            if slot is None or not table.mask[slot]:
                break
            slots.append(slot)
        if admit is not None and slots:
            del slots[admit(Run(np.array(slots, np.int64))) :]
        pinned = list(hashes[: len(slots)])
        for slot, block_hash in zip(slots, pinned, strict=True):
            table.pins[slot] += 1
            self.ref(BlockMeta.at(table, slot, block_hash))
        return pinned

    def unpin(self, hashes: Sequence[BlockHash]) -> None:
        """Undo ``pin`` for the same ids."""
        table = self._table
        for block_hash in hashes:
            slot = table.slot_of.get(block_hash)
            if slot is not None and table.pins[slot]:
                table.pins[slot] -= 1
        self.unref_all(hashes)


def file_forecast(
    index: BlockIndex, run: Run, next_use: float | None, *, past_forks: bool = False
) -> None:
    """Predict the blocks of ``run`` (a chain, root first) read again at ``next_use``, or
    (None) never: they leave first, the oldest first (``ORPHAN_BASE - last``). With
    ``past_forks`` (always with None: a branch given up), only the blocks past the deepest one
    with another child held (a fork: what lies before it is shared with another branch). A
    forecast may move a block's eviction key either way, so each tail the run has in each
    tier (the end of every stretch held there) is filed again; the other blocks are filed
    when they become tails. No touch: the lock is the caller's."""
    if not len(run):
        return
    table, at = index._table, run.at
    col = table.column
    slots = run.slots
    if next_use is None or past_forks:
        forks = np.flatnonzero(col("held")[at] > 1)
        if len(forks):
            slots = slots[forks[-1] + 1 :]
            if not len(slots):
                return
            at = slots
    if next_use is None:
        col("nxt")[at] = ORPHAN_BASE - col("last")[at]
    else:
        col("nxt")[at] = next_use
    masks = col("mask")[at]
    for tier in range(index._num_tiers):
        here = (masks & (1 << tier)) != 0
        ends = np.flatnonzero(here & ~np.append(here[1:], False))
        for i in ends:
            slot = int(slots[i])
            index._policy.track(BlockMeta.at(table, slot, table.key(slot)), tier)


def pin_sizes(index: BlockIndex, run: Run, into: int | None = None) -> npt.NDArray[np.int64]:
    """The bytes a lasting pin of ``run`` (a lease, a session pin) would add to its root's
    pinned bytes, per block (rows, in order) and tier (columns): a block's bytes in each tier
    holding it, nothing where a lease or a session pin holds it already. ``into``: a tier the
    blocks are then copied into (a locate), counted as holding each of them."""
    col, at = index._table.column, run.at
    held = (col("mask")[at][:, None] >> np.arange(index._num_tiers)) & 1
    nbytes = col("nbytes")[at][:, None]
    free = ((col("pins")[at] == 0) & (col("leased")[at] == 0))[:, None]
    sizes: npt.NDArray[np.int64] = nbytes * (held & free)
    if into is not None:  # a copy into ``into`` of a block pinned already adds its bytes
        sizes[:, into] = nbytes[:, 0] * ((held[:, into] == 0) | free[:, 0])
    return sizes


class Leases:
    """Leases over a ``BlockIndex``'s records: each pins its blocks until ``release`` or its
    expiry (``reap``)."""

    def __init__(self, index: BlockIndex) -> None:
        self._index = index
        self._leases: dict[str, Lease] = {}

    def take(self, metas: Sequence[BlockMeta], expires_at: float) -> Lease:
        """Pin ``metas`` until ``release`` or ``expires_at``."""
        lease = Lease(secrets.token_hex(16), tuple(m.block_hash for m in metas), expires_at)
        leased = self._index._table.leased
        for meta in metas:
            self._index.ref(meta)
            leased[meta.slot] += 1
        self._leases[lease.id] = lease
        return lease

    def release(self, lease_id: str, now: float) -> bool:
        """Unpin a lease's blocks; False when it is unknown or already over: released, reaped,
        or past its expiry at ``now`` though not reaped yet (then it is released now). True
        therefore means that its blocks stayed pinned from the lookup until now."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._end(lease)
        return lease.expires_at > now

    def reap(self, now: float) -> None:
        """Release the leases over at ``now``."""
        if not self._leases:
            return
        for lease_id in [k for k, v in self._leases.items() if v.expires_at <= now]:
            self._end(self._leases.pop(lease_id))

    def _end(self, lease: Lease) -> None:
        table = self._index._table
        for block_hash in lease.hashes:
            slot = table.slot_of.get(block_hash)
            if slot is not None and table.leased[slot]:
                table.leased[slot] -= 1
        self._index.unref_all(lease.hashes)

    def find(self, lease_id: str) -> Lease | None:
        """The live or not yet reaped lease of that id."""
        return self._leases.get(lease_id)

    def __len__(self) -> int:
        return len(self._leases)


def _pinned(index: BlockIndex, slot: int, tier: int, delta: int) -> None:
    """``delta`` more pinned bytes in ``tier``, node-wide and under the slot's root."""
    index.pinned_bytes[tier] += delta
    table = index._table
    root = table.root_list[table.root[slot]]
    per_tier = index.root_pinned.get(root)
    if per_tier is None:
        per_tier = index.root_pinned[root] = [0] * len(index.pinned_bytes)
    per_tier[tier] += delta
