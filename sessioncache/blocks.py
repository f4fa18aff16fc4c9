"""Per-block metadata kept by the store: one small record per cached block."""

from __future__ import annotations

from dataclasses import dataclass, field

from sessioncache.hashing import BlockHash


@dataclass(slots=True, eq=False)
class BlockMeta:
    """What the store knows of one block, wherever its payload lives.

    ``tiers`` holds the indices of the tiers that have the payload (a promoted block is in
    several); ``children_in[t]`` counts this block's children held in tier ``t``, which keeps
    a parent from being evicted before its tail. ``children_held`` counts its children held in any
    tier: the last copy of a parent is not dropped while a child of it is held anywhere.
    ``ref_cnt`` counts pins: leases, live sessions and in-flight moves; a block with
    ``ref_cnt > 0`` is never a victim. ``pins`` counts the live sessions' among them: those
    keep the block in the store, not its spare copies (see ``EvictionPolicy``).
    """

    block_hash: BlockHash
    parent: BlockHash | None
    namespace_root: bytes
    nbytes: int
    ttl_s: float
    created: float
    last_access: float
    expires_at: float
    children_in: list[int]
    tiers: set[int] = field(default_factory=set)
    ref_cnt: int = 0
    pins: int = 0
    children_held: int = 0
    hit_count: int = 0
    touched_by_op: int = 0
    touch_order: int = 0
    checksum: int | None = None

    def lru_key(self) -> tuple[float, int, int]:
        """Sort key of LRU order: older first; of one operation's blocks, the deepest first."""
        return (self.last_access, self.touched_by_op, -self.touch_order)

    def expired(self, now: float) -> bool:
        return self.expires_at <= now

    def evictable_from(self, tier: int, *, last: bool = False) -> bool:
        """Unpinned, held in ``tier``, and the tail of its chain there; from the ``last``
        tier (where a victim is dropped, not demoted) also not the last copy of a parent
        whose child is held elsewhere."""
        if self.ref_cnt or tier not in self.tiers or self.children_in[tier]:
            return False
        return not last or not self.children_held or len(self.tiers) > 1
