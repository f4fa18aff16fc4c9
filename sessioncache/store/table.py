"""The block table: what the store knows of every block, as a struct of arrays keyed by slot.

A node holds millions of blocks, so a block is not an object: it is a slot, an
integer, and each of its fields is one item in a typed NumPy array (machine words,
no object per value), so that a record costs ~150 bytes and a chain's fields lie side by side.
``slot_of`` maps an id to its slot; ``key(slot)`` is the id back.

Primitives:

* ``new(...)``: a slot for a new id (a freed one first, most recently freed first: the slots
  of a chain dropped tail first come back in chain order), every field written;
  ``free(slot)``: the id forgotten, the slot kept for reuse.
* Fields by slot: read and written in place (``table.expires[slot]``, ``table.mask[slot]``);
  the per-tier child counts are ``children_in[slot * num_tiers + tier]``.
* Chain links: each slot's children form a doubly linked list through ``first_kid``,
  ``next_kid`` and ``prev_kid`` (``NO_SLOT`` ends it); ``link_kid``/``unlink_kid``/``kids``.
* ``column(name)``: a NumPy view of a field for whole-run reads and writes (a lookup reads and
  touches a matched run with a handful of array operations, not a Python loop per block),
  and ``id_view()`` the ids as ``(slots, 2)`` uint64 words. A view must not outlive the call
  that made it: a growing table moves to new arrays.

Not locked and never doing I/O: its one owner, the ``BlockIndex``, is called with the store's
lock held.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from sessioncache.hashing import HASH_BYTES, BlockHash

NO_SLOT = -1
"""The end of a chain-link list; no slot."""

F_PARENT = 1
"""``flags`` bit: the block has a parent (``parents[slot]``)."""
F_CHECKSUM = 2
"""``flags`` bit: ``checksum[slot]`` is known."""
F_LIVE = 4
"""``flags`` bit: the slot holds a record (a freed slot keeps its other fields a while)."""

# The typed columns: name, array type code. Every slot has one item in each (``children_in``:
# ``num_tiers`` items).
_COLUMNS: tuple[tuple[str, str], ...] = (
    ("nbytes", "q"),
    ("ttl", "d"),
    ("created", "d"),
    ("last", "d"),
    ("nxt", "d"),
    ("expires", "d"),
    ("mask", "B"),
    ("root", "I"),
    ("flags", "B"),
    ("ref", "i"),
    ("pins", "i"),
    ("leased", "i"),
    ("held", "i"),
    ("hits", "q"),
    ("order", "q"),
    ("op", "q"),
    ("checksum", "Q"),
    ("first_kid", "i"),
    ("next_kid", "i"),
    ("prev_kid", "i"),
)


class BlockFields(NamedTuple):
    """The fields of a new record (``BlockTable.new``)."""

    block_hash: BlockHash
    parent: BlockHash | None
    namespace_root: bytes
    nbytes: int
    ttl_s: float
    created: float
    last_access: float
    expires_at: float
    ref_cnt: int = 0
    pins: int = 0
    children_held: int = 0
    hit_count: int = 0
    touch_order: int = 0
    touched_by_op: int = 0
    mask: int = 0
    """The tiers holding the payload, a bit per tier."""
    checksum: int | None = None
    next_use: float = float("-inf")
    """When the block is predicted to be read again (``sessioncache.store.forecast``; -inf: no
    forecast)."""


class BlockTable:
    """Block records as parallel arrays indexed by slot (see the module docstring)."""

    def __init__(self, num_tiers: int, capacity: int = 64, *, detached: bool = False) -> None:
        """``detached``: a table of one slot in plain lists (a ``BlockMeta`` of its own: made
        in microseconds, where NumPy arrays take tens); it cannot grow nor give ``column``
        views."""
        self.num_tiers = num_tiers
        self.slots_tier = -1
        """The tier whose slots a lease hands out (the shared-memory tier: ``reads.locate``),
        where a lease holds the block's copy itself; in the other tiers a lease holds the
        block, not each of its copies (``BlockMeta.standing``). -1: none."""
        self.slot_of: dict[BlockHash, int] = {}
        """The slot of each id that has a record."""
        self.parents: list[BlockHash | None] = []
        self.root_list: list[bytes] = []
        """The namespace roots, numbered: a slot's is ``root_list[root[slot]]``."""
        self._root_number: dict[bytes, int] = {}
        self._size = 0
        self._free: list[int] = []
        self._zeros = [0] * num_tiers
        # The columns live in NumPy arrays of ``_capacity`` slots, doubled when full (a new
        # array and a copy: large ones are fresh mappings, so the unused half costs no RAM
        # until written, and the old one goes back whole); Python reads and writes single
        # items through memoryviews of them, which give plain ints and floats.
        self._capacity = 0
        self._arrays: dict[str, npt.NDArray[Any]] = {}
        if detached:
            for name, code in _COLUMNS:
                setattr(self, name, [0.0 if code == "d" else 0])
            self.children_in = [0] * num_tiers  # type: ignore[assignment]
            self._id_bytes = memoryview(bytearray(HASH_BYTES))
            self._capacity = 1
        else:
            self._grow(capacity)

    def __len__(self) -> int:
        return len(self.slot_of)

    @property
    def size(self) -> int:
        """Slots in use or freed (the columns' valid length)."""
        return self._size

    @property
    def id_bytes(self) -> memoryview:
        """The ids, 16 bytes per slot (all slots up to the capacity)."""
        return self._id_bytes

    def key(self, slot: int) -> BlockHash:
        """The id of ``slot`` (of a freed slot: its last one)."""
        return BlockHash(bytes(self._id_bytes[slot * HASH_BYTES : (slot + 1) * HASH_BYTES]))

    def namespace_root(self, slot: int) -> bytes:
        return self.root_list[self.root[slot]]

    def _grow(self, capacity: int) -> None:
        size = self._size
        shapes = [(name, code, 1) for name, code in _COLUMNS]
        shapes += [("children_in", "i", self.num_tiers), ("ids", "Q", 2)]
        for name, code, width in shapes:
            new = np.empty(capacity * width, dtype=code)
            old = self._arrays.get(name)
            if old is not None:
                new[: size * width] = old[: size * width]
            self._arrays[name] = new
            setattr(self, name, new.data)
        self._id_bytes = self._arrays["ids"].view(np.uint8).data
        self._capacity = capacity

    # Item views of the columns (set by ``_grow``), typed for the code that reads them.
    nbytes: memoryview[int]
    ttl: memoryview[float]
    created: memoryview[float]
    last: memoryview[float]
    """When last accessed."""
    nxt: memoryview[float]
    """When predicted to be read again (``sessioncache.store.forecast``)."""
    expires: memoryview[float]
    mask: memoryview[int]
    """The tiers holding the payload, a bit each."""
    root: memoryview[int]
    """The number of the namespace root (``root_list``)."""
    flags: memoryview[int]
    ref: memoryview[int]
    pins: memoryview[int]
    leased: memoryview[int]
    """Leases holding the block (``ref`` counts them too)."""
    held: memoryview[int]
    """Children held in any tier."""
    hits: memoryview[int]
    order: memoryview[int]
    """Touch order: orders a chain's blocks touched by one operation."""
    op: memoryview[int]
    """The operation that last touched the block."""
    checksum: memoryview[int]
    first_kid: memoryview[int]
    next_kid: memoryview[int]
    prev_kid: memoryview[int]
    children_in: memoryview[int]
    """Children held per tier: ``num_tiers`` items per slot."""

    # -- slots --------------------------------------------------------------------------

    def new(self, fields: BlockFields) -> int:
        """A slot holding a new record of ``fields.block_hash`` (no kids, no children
        counted)."""
        f = fields
        block_hash, parent, namespace_root = f.block_hash, f.parent, f.namespace_root
        root = self._root_number.get(namespace_root)
        if root is None:
            root = self._root_number[namespace_root] = len(self.root_list)
            self.root_list.append(namespace_root)
        if self._free:
            slot = self._free.pop()
            self.parents[slot] = parent
        else:
            slot = self._size
            if slot == self._capacity:
                self._grow(2 * self._capacity)
            self._size += 1
            self.parents.append(parent)
        self.root[slot] = root
        self._id_bytes[slot * HASH_BYTES : (slot + 1) * HASH_BYTES] = block_hash
        self.nbytes[slot] = f.nbytes
        self.ttl[slot] = f.ttl_s
        self.created[slot] = f.created
        self.last[slot] = f.last_access
        self.nxt[slot] = f.next_use
        self.expires[slot] = f.expires_at
        self.mask[slot] = f.mask
        self.flags[slot] = (
            F_LIVE
            | (F_PARENT if parent is not None else 0)
            | (F_CHECKSUM if f.checksum is not None else 0)
        )
        self.ref[slot] = f.ref_cnt
        self.pins[slot] = f.pins
        self.leased[slot] = 0
        self.held[slot] = f.children_held
        self.hits[slot] = f.hit_count
        self.order[slot] = f.touch_order
        self.op[slot] = f.touched_by_op
        self.checksum[slot] = f.checksum or 0
        self.first_kid[slot] = self.next_kid[slot] = self.prev_kid[slot] = NO_SLOT
        t = self.num_tiers
        self.children_in[slot * t : (slot + 1) * t] = _int_items(self._zeros)
        self.slot_of[block_hash] = slot
        return slot

    def new_many(
        self,
        block_hashes: Sequence[BlockHash],
        parents: Sequence[BlockHash | None],
        namespace_roots: Sequence[bytes],
        nbytes: npt.NDArray[np.int64],
        ttl_s: npt.NDArray[np.float64],
        created: npt.NDArray[np.float64],
        last_access: npt.NDArray[np.float64],
        expires_at: npt.NDArray[np.float64],
        mask: int,
        touch_order: int,
        next_use: npt.NDArray[np.float64] | float = float("-inf"),
    ) -> int:
        """``new`` of many ids not in the table (no duplicates), unpinned, in consecutive new
        slots, a column at a time; touch orders from ``touch_order`` on. No kids are linked
        (see ``BlockIndex.relink``). Returns the first slot."""
        n = len(block_hashes)
        start = self._size
        if start + n > self._capacity:
            self._grow(max(2 * self._capacity, start + n))
        end = start + n
        self._size = end
        self.parents.extend(parents)
        roots = []
        for root in namespace_roots:
            number = self._root_number.get(root)
            if number is None:
                number = self._root_number[root] = len(self.root_list)
                self.root_list.append(root)
            roots.append(number)
        has_parent = np.fromiter((p is not None for p in parents), bool, n)
        a = self._arrays
        a["ids"][2 * start : 2 * end] = np.frombuffer(b"".join(block_hashes), np.uint64)
        a["root"][start:end] = roots
        a["nbytes"][start:end] = nbytes
        a["ttl"][start:end] = ttl_s
        a["created"][start:end] = created
        a["last"][start:end] = last_access
        a["nxt"][start:end] = next_use
        a["expires"][start:end] = expires_at
        a["mask"][start:end] = mask
        a["flags"][start:end] = F_LIVE | np.where(has_parent, F_PARENT, 0)
        for name in ("ref", "pins", "leased", "held", "hits", "op", "checksum"):
            a[name][start:end] = 0
        a["order"][start:end] = np.arange(touch_order, touch_order + n)
        for name in ("first_kid", "next_kid", "prev_kid"):
            a[name][start:end] = NO_SLOT
        t = self.num_tiers
        a["children_in"][start * t : end * t] = 0
        self.slot_of.update(zip(block_hashes, range(start, end), strict=True))
        return start

    def free(self, slot: int) -> None:
        """Forget the record in ``slot`` (its id no longer maps to it): held nowhere and
        unpinned from now on; its other fields stay readable until the slot is reused, so that
        a caller may still report on it."""
        del self.slot_of[self.key(slot)]
        self.flags[slot] &= ~F_LIVE
        self.mask[slot] = self.ref[slot] = self.pins[slot] = self.leased[slot] = 0
        self._free.append(slot)

    def slots(self) -> Iterator[int]:
        """The slots holding records."""
        return iter(self.slot_of.values())

    # -- chain links --------------------------------------------------------------------

    def kids(self, slot: int) -> Iterator[int]:
        return self.kids_from(self.first_kid[slot])

    def kids_from(self, first: int) -> Iterator[int]:
        kid = first
        while kid != NO_SLOT:
            yield kid
            kid = self.next_kid[kid]

    def push_kid(self, first: int, kid: int) -> int:
        """Put ``kid`` at the head of the list starting at ``first``; returns the new head."""
        self.prev_kid[kid] = NO_SLOT
        self.next_kid[kid] = first
        if first != NO_SLOT:
            self.prev_kid[first] = kid
        return kid

    def drop_kid(self, first: int, kid: int) -> int:
        """Take ``kid`` out of the list starting at ``first``; returns the new head."""
        before, after = self.prev_kid[kid], self.next_kid[kid]
        if after != NO_SLOT:
            self.prev_kid[after] = before
        if before != NO_SLOT:
            self.next_kid[before] = after
        else:
            first = after
        self.prev_kid[kid] = self.next_kid[kid] = NO_SLOT
        return first

    # -- per-tier child counts -------------------------------------------------------------

    def children_in_of(self, slot: int) -> tuple[int, ...]:
        t = self.num_tiers
        return tuple(self.children_in[slot * t : (slot + 1) * t])

    def set_children_in(self, slot: int, values: Iterable[int]) -> None:
        t = self.num_tiers
        self.children_in[slot * t : (slot + 1) * t] = _int_items(values)

    # -- whole-run views ------------------------------------------------------------------

    def column(self, name: str) -> npt.NDArray[Any]:
        """A NumPy view of a column's valid slots (see the module docstring)."""
        width = self.num_tiers if name == "children_in" else 1
        return self._arrays[name][: self._size * width]

    def id_view(self) -> npt.NDArray[np.uint64]:
        """The ids, ``(slots, 2)`` words (a view; see ``column``)."""
        ids: npt.NDArray[np.uint64] = self._arrays["ids"][: 2 * self._size]
        return ids.reshape(-1, 2)


def _int_items(values: Iterable[int]) -> memoryview:
    """``values`` as a buffer of C ints, to assign to a slice of an ``int`` column."""
    return memoryview(array("i", values))
