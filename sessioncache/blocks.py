"""Per-block metadata kept by the store: one small record per cached block."""

from __future__ import annotations

from dataclasses import dataclass, field

from sessioncache.hashing import BlockHash


@dataclass(slots=True, eq=False)
class BlockMeta:
    """What the store knows of one block, wherever its payload lives.

    ``tiers`` holds the indices of the tiers that have the payload (a promoted block is in
    several); ``child_count[t]`` counts this block's children held in tier ``t``, which keeps
    a parent from being evicted before its tail. ``ref_cnt`` counts pins: leases, live
    sessions and in-flight moves; a block with ``ref_cnt > 0`` is never a victim.
    """

    block_hash: BlockHash
    parent: BlockHash | None
    namespace_root: bytes
    nbytes: int
    ttl_s: float
    created: float
    last_access: float
    expires_at: float
    child_count: list[int]
    tiers: set[int] = field(default_factory=set)
    ref_cnt: int = 0
    hit_count: int = 0
    touch_op: int = 0
    touch_seq: int = 0

    def lru_key(self) -> tuple[float, int, int]:
        """Sort key of LRU order: older first; of one operation's blocks, the deepest first."""
        return (self.last_access, self.touch_op, -self.touch_seq)

    def expired(self, now: float) -> bool:
        return self.expires_at <= now

    def evictable_from(self, tier: int) -> bool:
        """Unpinned, held in ``tier``, and the tail of its chain there."""
        return self.ref_cnt == 0 and tier in self.tiers and self.child_count[tier] == 0
