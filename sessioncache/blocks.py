"""Per-block metadata kept by the store: one small record per cached block.

A store holds millions of these, so the record is compact (issue 15): plain ``__slots__``,
the tiers holding the block as a bit mask (``tiers`` reads it as a shared frozenset), the
per-tier child counts as a shared tuple (``children_in``), and the ids of its children inline
(one id, or a set for a branching block) rather than in a separate map of sets. A touch only
rebinds fields: it allocates nothing but the new expiry (shared by one touch's blocks).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

from sessioncache.hashing import BlockHash

Kids = BlockHash | set[BlockHash] | None
"""A block's children: none, one id, or a set of ids (a block with several children)."""


@cache
def tier_set(mask: int) -> frozenset[int]:
    """The tier indices of a bit mask, one shared frozenset per mask."""
    return frozenset(i for i in range(mask.bit_length()) if mask >> i & 1)


def tier_mask(tiers: Iterable[int]) -> int:
    mask = 0
    for tier in tiers:
        mask |= 1 << tier
    return mask


_COUNTS: dict[tuple[int, ...], tuple[int, ...]] = {}
_INTERN_BELOW = 64  # counts this small are shared; a record with bigger ones keeps its own tuple
_INTERNED_MAX = 1 << 16


def counts(values: Iterable[int]) -> tuple[int, ...]:
    """``values`` as a tuple, shared between records when its values are small."""
    key = tuple(values)
    shared = _COUNTS.get(key)
    if shared is not None:
        return shared
    if len(_COUNTS) < _INTERNED_MAX and max(key, default=0) < _INTERN_BELOW:
        _COUNTS[key] = key
    return key


def bumped(values: tuple[int, ...], tier: int, delta: int) -> tuple[int, ...]:
    """``values`` with ``values[tier] += delta``."""
    changed = list(values)
    changed[tier] += delta
    return counts(changed)


class BlockMeta:
    """What the store knows of one block, wherever its payload lives.

    ``tiers`` holds the indices of the tiers that have the payload (a promoted block is in
    several; stored as the bit mask ``mask``); ``children_in[t]`` counts this block's children
    held in tier ``t``, which keeps a parent from being evicted before its tail.
    ``children_held`` counts its children held in any tier: the last copy of a parent is not
    dropped while a child of it is held anywhere. ``ref_cnt`` counts pins: leases, live
    sessions and in-flight moves; a block with ``ref_cnt > 0`` is never a victim. ``pins``
    counts the live sessions' among them: those keep the block in the store, not its spare
    copies (see ``EvictionPolicy``). ``kids`` are the ids of its children (held or not) that
    have records, kept by the ``BlockIndex``.
    """

    __slots__ = (
        "block_hash",
        "checksum",
        "children_held",
        "children_in",
        "created",
        "expires_at",
        "hit_count",
        "kids",
        "last_access",
        "mask",
        "namespace_root",
        "nbytes",
        "parent",
        "pins",
        "ref_cnt",
        "touch_order",
        "touched_by_op",
        "ttl_s",
    )

    def __init__(
        self,
        block_hash: BlockHash,
        parent: BlockHash | None,
        namespace_root: bytes,
        nbytes: int,
        ttl_s: float,
        created: float,
        last_access: float,
        expires_at: float,
        children_in: Iterable[int],
        tiers: Iterable[int] = (),
        ref_cnt: int = 0,
        pins: int = 0,
        children_held: int = 0,
        hit_count: int = 0,
        touched_by_op: int = 0,
        touch_order: int = 0,
        checksum: int | None = None,
    ) -> None:
        self.block_hash = block_hash
        self.parent = parent
        self.namespace_root = namespace_root
        self.nbytes = nbytes
        self.ttl_s = ttl_s
        self.created = created
        self.last_access = last_access
        self.expires_at = expires_at
        self.children_in: tuple[int, ...] = counts(children_in)
        self.mask = tier_mask(tiers)
        self.ref_cnt = ref_cnt
        self.pins = pins
        self.children_held = children_held
        self.hit_count = hit_count
        self.touched_by_op = touched_by_op
        self.touch_order = touch_order
        self.checksum = checksum
        self.kids: Kids = None

    @property
    def tiers(self) -> frozenset[int]:
        return tier_set(self.mask)

    @tiers.setter
    def tiers(self, tiers: Iterable[int]) -> None:
        self.mask = tier_mask(tiers)

    def copy(self) -> BlockMeta:
        """A detached copy (its ``kids`` copied too)."""
        other = BlockMeta.__new__(BlockMeta)
        for name in BlockMeta.__slots__:
            setattr(other, name, getattr(self, name))
        if isinstance(self.kids, set):
            other.kids = set(self.kids)
        return other

    def __repr__(self) -> str:
        return (
            f"BlockMeta({self.block_hash.hex()}, parent="
            f"{self.parent.hex() if self.parent is not None else None}, tiers={set(self.tiers)}, "
            f"ref_cnt={self.ref_cnt}, pins={self.pins}, expires_at={self.expires_at})"
        )

    def lru_key(self) -> tuple[float, int, int]:
        """Sort key of LRU order: older first; of one operation's blocks, the deepest first."""
        return (self.last_access, self.touched_by_op, -self.touch_order)

    def expired(self, now: float) -> bool:
        return self.expires_at <= now

    def evictable_from(self, tier: int, *, last: bool = False) -> bool:
        """Unpinned, held in ``tier``, and the tail of its chain there; from the ``last``
        tier (where a victim is dropped, not demoted) also not the last copy of a parent
        whose child is held elsewhere."""
        mask = self.mask
        if self.ref_cnt or not mask >> tier & 1 or self.children_in[tier]:
            return False
        return not last or not self.children_held or mask & (mask - 1) != 0
