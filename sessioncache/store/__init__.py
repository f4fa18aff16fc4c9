"""The tiered block store: one index over a stack of tiers, fastest first.

Data flow (``docs/architecture.md`` has the pictures):

* ``reads.lookup(hashes)`` walks the chain from its root and stops at the first block that is not
  held or has expired; it touches the matched prefix (sliding TTL, LRU order) and optionally
  leases it, so that it cannot be evicted between the lookup and the load. Counted in the
  ``lookups`` and ``hit_blocks`` counters, which count what engines ask (the node's own
  lookups pass ``counted=False``: a store's plan, a load). ``reads.touch(hashes)`` touches
  the same prefix without counting (a session noting activity on blocks already looked up).
* ``writes.put(hashes, payloads, parent=...)`` stores a chain segment into the first tier (or the
  one named). A full tier makes room by evicting victims chosen by the ``EvictionPolicy``;
  a victim is demoted to the next tier (write-back) unless it has expired or the tier is the
  last, where it is dropped. ``durable=True`` also writes through to the first durable tier
  before returning.
* ``reads.get(hash)`` reads from the fastest tier holding the block and, when configured, copies a
  hit from a lower tier up into the first tier (promotion).
* The same-host data path (``docs/dataplane.md``, "Same host"), over the store's
  shared-memory tier (``tiers.base.SharedMemoryTier``, the CPU tier in memfd segments):
  ``reads.locate(hashes)`` says where each block of a leased match lies in it, copying into it first
  the blocks held only elsewhere; ``writes.stage`` reserves slots that another process fills in
  place, ``writes.commit`` verifies and publishes them as blocks, ``writes.abort`` frees them.

Modules: ``tiered`` (``TieredStore``, which holds the parts), ``core`` (``StoreCore``: the
tiers, the index, placement, eviction and promotion), ``reads``, ``writes`` (the one write
path), ``recovery`` (what durable tiers found) and ``results`` (what they hand out).

The store orchestrates: tiers, moves between them, observers, counters. What it knows of the
blocks (records, chain links, per-tier counts, pins, leases) is the ``BlockIndex``
(``sessioncache/store/index.py``); who leaves a full tier and who may enter it, the
``EvictionPolicy`` (``sessioncache/store/eviction.py``).

Threading model: one re-entrant lock guards the index (block records, leases, policy heaps,
counters). Payload copies and file I/O run outside it, so that a put demoting a block to disk
never stalls lookups; a block being copied holds a transient pin (``ref_cnt``), and a block
being stored is invisible to lookups until its first tier has the whole payload. Tiers are
themselves thread-safe; the store never calls back into itself from a tier, so the lock order
is always store, then tier.
"""

from sessioncache.store.results import (
    DEFAULT_TTL_S,
    Counters,
    LocatedSlot,
    Match,
    NamespaceUsage,
    StoreStats,
    TierStats,
    Write,
    WriteResult,
)
from sessioncache.store.tiered import TieredStore

__all__ = [
    "DEFAULT_TTL_S",
    "Counters",
    "LocatedSlot",
    "Match",
    "NamespaceUsage",
    "StoreStats",
    "TierStats",
    "TieredStore",
    "Write",
    "WriteResult",
]
