"""What the store tells its observers (the catalog, metrics): a narrow, synchronous protocol.

Observers are called with the store's lock held, in the order things happened, so they must
not block and must not call back into the store: copy what you need and queue it (the catalog
batches these into SQL write-behind; metrics bump counters).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from sessioncache.hashing import BlockHash
from sessioncache.store.blocks import BlockMeta


@dataclass(frozen=True, slots=True)
class Touched:
    """Blocks a lookup, get or put refreshed, a list per field (read from the store's table a
    column at a time; a chain's touch is one of these, not an object per block): item ``i`` of
    each list is block ``hashes[i]``'s value after the touch."""

    hashes: Sequence[BlockHash]
    masks: list[int]
    """The tiers holding each block, a bit each (``BlockMeta.mask``)."""
    last_access: list[float]
    expires_at: list[float]
    hit_count: list[int]
    ref_cnt: list[int]
    ttl_s: list[float]

    def __len__(self) -> int:
        return len(self.masks)


class StoreObserver(Protocol):
    def block_added(self, meta: BlockMeta, tier: str, durable: bool) -> None:
        """``meta``'s payload is now held in ``tier`` (``durable``: the tier survives crashes)."""

    def block_removed(self, block_hash: BlockHash, tier: str, durable: bool) -> None:
        """The payload left ``tier`` (evicted, demoted, expired, deleted or found corrupt)."""

    def blocks_touched(self, touched: Touched) -> None:
        """A lookup, get or put refreshed these blocks' access time, expiry or hit count."""


@runtime_checkable
class DropObserver(Protocol):
    """An observer that also hears when a block's last copy leaves the store (miss
    attribution, ``sessioncache/attribution.py``); same rules as ``StoreObserver``."""

    def block_dropped(self, meta: BlockMeta, tier: str, now: float) -> None:
        """``meta``'s last copy left ``tier`` at ``now`` (evicted, expired or deleted)."""


class UsageRecorder(Protocol):
    """Where a node's usage counters go, bucketed over time (the catalog's ``usage`` table)."""

    def record_usage(self, name: str, amount: int = 1, *, at: float | None = None) -> None:
        """Add ``amount`` to counter ``name`` now (or ``at``); must not block."""
