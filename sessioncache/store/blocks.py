"""Per-block metadata kept by the store, as the rest of the code reads it.

The records themselves are a struct of arrays (``sessioncache/store/table.py``: a block is a slot);
a ``BlockMeta`` is a small handle on one slot whose attributes read and write that slot's
fields, made when code asks for a block and dropped after. One made with
``BlockMeta.detached(BlockFields(...))`` owns a table of its own (a detached record:
snapshots, tests).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import Generic, Self, TypeVar, overload

from sessioncache.hashing import BlockHash
from sessioncache.store.table import F_CHECKSUM, F_PARENT, BlockFields, BlockTable


@cache
def tier_set(mask: int) -> frozenset[int]:
    """The tier indices of a bit mask, one shared frozenset per mask."""
    return frozenset(i for i in range(mask.bit_length()) if mask >> i & 1)


def tier_mask(tiers: Iterable[int]) -> int:
    mask = 0
    for tier in tiers:
        mask |= 1 << tier
    return mask


_V = TypeVar("_V", int, float)


class _Field(Generic[_V]):
    """A read-only field of ``BlockMeta``: the item of the table's column ``column`` at the
    handle's slot."""

    __slots__ = ("column",)

    def __init__(self, column: str) -> None:
        self.column = column

    @overload
    def __get__(self, meta: None, owner: type[BlockMeta]) -> Self: ...
    @overload
    def __get__(self, meta: BlockMeta, owner: type[BlockMeta]) -> _V: ...
    def __get__(self, meta: BlockMeta | None, owner: type[BlockMeta]) -> _V | Self:
        if meta is None:
            return self
        items: memoryview[_V] = getattr(meta._table, self.column)
        return items[meta.slot]


class _MutableField(_Field[_V]):
    """A field of ``BlockMeta`` that is also written in place."""

    __slots__ = ()

    def __set__(self, meta: BlockMeta, value: _V) -> None:
        items: memoryview[_V] = getattr(meta._table, self.column)
        items[meta.slot] = value


class BlockMeta:
    """What the store knows of one block, wherever its payload lives: a handle on the block's
    slot in a ``BlockTable`` (see the module docstring).

    ``tiers`` holds the indices of the tiers that have the payload (a promoted block is in
    several; stored as the bit mask ``mask``); ``children_in[t]`` counts this block's children
    held in tier ``t`` and ``children_held`` its children held in any tier. ``ref_cnt``
    counts references: leases, live sessions, writes and the node's own moves in flight;
    ``pins`` counts the live sessions' among them. What these mean for eviction (a parent
    leaves after its tail, nothing referenced leaves, a session pin keeps the block but not
    its spare copies) is ``store.eviction``'s.
    """

    __slots__ = ("_table", "block_hash", "slot")
    _table: BlockTable
    block_hash: BlockHash
    slot: int

    @classmethod
    def detached(cls, fields: BlockFields, children_in: Iterable[int] = ()) -> BlockMeta:
        """A record in a table of its own (snapshots, tests); ``children_in`` per tier."""
        per_tier = list(children_in)
        table = BlockTable(max(len(per_tier), 1), detached=True)
        slot = table.new(fields)
        if per_tier:
            table.set_children_in(slot, per_tier)
        return cls.at(table, slot, fields.block_hash)

    @classmethod
    def at(cls, table: BlockTable, slot: int, block_hash: BlockHash) -> BlockMeta:
        """The handle on ``slot`` of ``table``, the record of ``block_hash``."""
        meta = cls.__new__(cls)
        meta._table = table
        meta.slot = slot
        meta.block_hash = block_hash
        return meta

    @property
    def live(self) -> bool:
        """Whether the slot still holds this block's record. A handle kept past the record's
        end (forgotten, its slot reused by another block) reads as held nowhere and is
        ignored by the index, as a detached record was."""
        return self._table.slot_of.get(self.block_hash) == self.slot

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, BlockMeta)
            and other._table is self._table
            and other.slot == self.slot
            and other.block_hash == self.block_hash
        )

    def __hash__(self) -> int:
        return hash((self.slot, self.block_hash))

    # -- fields -------------------------------------------------------------------------

    @property
    def parent(self) -> BlockHash | None:
        t = self._table
        return t.parents[self.slot] if t.flags[self.slot] & F_PARENT else None

    @property
    def namespace_root(self) -> bytes:
        return self._table.namespace_root(self.slot)

    nbytes: _Field[int] = _Field("nbytes")
    ttl_s: _MutableField[float] = _MutableField("ttl")
    created: _Field[float] = _Field("created")
    last_access: _MutableField[float] = _MutableField("last")
    next_use: _MutableField[float] = _MutableField("nxt")
    """When the block is predicted to be read again (``sessioncache.store.forecast``)."""
    expires_at: _MutableField[float] = _MutableField("expires")

    @property
    def mask(self) -> int:
        t, slot = self._table, self.slot
        return t.mask[slot] if t.slot_of.get(self.block_hash) == slot else 0

    @mask.setter
    def mask(self, value: int) -> None:
        self._table.mask[self.slot] = value

    ref_cnt: _MutableField[int] = _MutableField("ref")
    pins: _MutableField[int] = _MutableField("pins")
    children_held: _MutableField[int] = _MutableField("held")

    @property
    def children_in(self) -> tuple[int, ...]:
        return self._table.children_in_of(self.slot)

    @children_in.setter
    def children_in(self, values: Iterable[int]) -> None:
        self._table.set_children_in(self.slot, values)

    hit_count: _MutableField[int] = _MutableField("hits")
    touch_order: _MutableField[int] = _MutableField("order")
    touched_by_op: _MutableField[int] = _MutableField("op")

    @property
    def checksum(self) -> int | None:
        t = self._table
        return t.checksum[self.slot] if t.flags[self.slot] & F_CHECKSUM else None

    @checksum.setter
    def checksum(self, value: int | None) -> None:
        t, slot = self._table, self.slot
        if value is None:
            t.flags[slot] &= ~F_CHECKSUM
        else:
            t.checksum[slot] = value
            t.flags[slot] |= F_CHECKSUM

    @property
    def tiers(self) -> frozenset[int]:
        return tier_set(self.mask)

    @tiers.setter
    def tiers(self, tiers: Iterable[int]) -> None:
        self._table.mask[self.slot] = tier_mask(tiers)

    # -- derived ------------------------------------------------------------------------

    def copy(self) -> BlockMeta:
        """A detached copy, in a table of its own."""
        fields = BlockFields(
            self.block_hash,
            self.parent,
            self.namespace_root,
            self.nbytes,
            self.ttl_s,
            self.created,
            self.last_access,
            self.expires_at,
            ref_cnt=self.ref_cnt,
            pins=self.pins,
            children_held=self.children_held,
            hit_count=self.hit_count,
            touched_by_op=self.touched_by_op,
            touch_order=self.touch_order,
            mask=self.mask,
            checksum=self.checksum,
            next_use=self.next_use,
        )
        return BlockMeta.detached(fields, self.children_in)

    def __repr__(self) -> str:
        return (
            f"BlockMeta({self.block_hash.hex()}, parent="
            f"{self.parent.hex() if self.parent is not None else None}, tiers={set(self.tiers)}, "
            f"ref_cnt={self.ref_cnt}, pins={self.pins}, expires_at={self.expires_at})"
        )

    def expired(self, now: float) -> bool:
        return self._table.expires[self.slot] <= now

    def standing(self, tier: int) -> tuple[int, int, int, int, int]:
        """What eviction's rules (``store.eviction``) read of the block in ``tier``, at once:
        its tier mask, its references (``ref_cnt``), those of them that hold the block rather
        than its copy in ``tier`` (its session pins, and its leases but in the tier whose
        slots a lease hands out: ``BlockTable.slots_tier``), its children held in ``tier``
        and its children held in any tier."""
        t, slot = self._table, self.slot
        return (
            t.mask[slot],
            t.ref[slot],
            t.pins[slot] + (t.leased[slot] if tier != t.slots_tier else 0),
            t.children_in[slot * t.num_tiers + tier],
            t.held[slot],
        )

    def order_keys(self) -> tuple[float, float, int, int, float]:
        """What the eviction orders sort the block by, read at once: its last access, its
        expiry, its LRU tie-breakers (the operation that touched it, minus its touch order)
        and its predicted next use."""
        t, slot = self._table, self.slot
        return t.last[slot], t.expires[slot], t.op[slot], -t.order[slot], t.nxt[slot]
