"""Eviction, in one place: who may leave a full tier, in which order, where a victim goes, and
who may enter a tier at that price. The store's core runs the loop (``StoreCore.make_room``:
pop a victim, ask ``admits``, move it as ``demotes`` says); the rules are all here. The
forecast behind the default order is ``sessioncache.store.forecast``'s (this module calls it).

What may not leave (``may_leave``, ``is_tail``, ``is_spare``; the index offers a block to the
policy, ``track``, whenever one of them may have become true):
1. A referenced block (``ref_cnt > 0``: a lease, a live session's pin, a write in flight, the
   node's own copy to a lower or the durable tier) is never a victim. A session pin or a
   lease keeps the block in the store, but not its spare copies (4. below): a lease holds
   each copy only in the tier whose slots it hands out (the shared-memory tier).
2. The tail rule: a block whose child is held in the same tier is not a victim before that
   child: chains are evicted tail first, since a child is useless without its parent. In the
   last tier, where victims are dropped rather than demoted, the last copy of a parent is not
   a victim while a child of it is held in any tier.

Victim order, per tier:
3. Among the remaining chain tails, expired blocks (``expires_at <= now``) go first, earliest
   expiry first.
4. Then spare copies: below the first tier, a block also held in a faster tier, tail or
   not, least recently used first; dropping it loses nothing, so the tiers hold distinct
   blocks whenever room is short (as an exclusive LRU stack does: a chain promoted as an
   engine loads it leaves room below for what it pushes down). Session pins and leases keep
   a block, not its spare copies.
5. Then, with a ``Forecast`` (the default), by the block's forecast
   (``sessioncache.store.forecast``: each block's key, from its session's return distribution,
   against its last access): in the ``next_use`` mode the tail whose predicted next use lies
   furthest ahead (Belady's rule with predictions: the larger of the key, capped at
   ``beyond`` horizons ahead, and how overdue it is), in the ``value`` mode the tail that went
   cold first (the key where there is one, LRU's date otherwise), in the ``chance`` mode the
   tail of least hit density now (the tops of two heaps per finish class, oldest event first
   and newest event first,
   of the furthest key, and of the oldest block with no key, compared); without one (``lru``, the
   setting ``SESSIONCACHE_EVICTION_POLICY=lru``), least recently used first. Blocks no
   session forecasts keep LRU's order among themselves. Blocks touched at the same instant
   are ordered by the operation that touched them (earlier first) and, within one operation
   (a lookup walking a chain), deepest first, so a chain is eaten from its tail.

Where a victim goes (``demotes``): into the next tier (which may evict in turn), unless it is
expired, the tier is the last, or another tier holds it too; then it is dropped from the tier.
Dropping a block may make its parent a tail.

Admission (``admits``, the price of entering): a block entering a tier takes the place of that
tier's next victim unless the victim is unexpired, its copy there is not spare (a faster tier
holds it too: dropping it loses nothing, whoever enters), and it is either
* hotter than the incoming block, which is new or promoted (held in no faster tier): the
  incoming block belongs lower down, so a chain
  longer than the fast tier keeps its head fast and its tail lower instead of shredding
  what is there. Hotter is LRU's order, under a forecast too (no bypass by forecast: in the
  last tier it would refuse stores; docs/sessions.md). A demoted block is not judged again:
  it was the coldest above, and refusing it would drop it (orphaning any tail of it held
  below); or
* the only copy, in the last tier, of the incoming block's own parent: admitting the child
  would orphan it. Under a forecast, the incoming block's parent in any tier: it comes up as
  the victim only when its chain is expected back after every other tail there, and the
  child is read no sooner than the parent, so the child goes lower, or in the last tier
  nowhere (Belady's bypass: a store cut short, answered dropped). A spare copy of the
  parent says nothing of that: it comes up first whatever its chain's forecast, and the
  parent stays held above.

Each tier's turnover (``forecast.Horizon``: how long the tier keeps a block) is counted from
the victims that leave it (``left``, once per victim; a spare copy's says nothing of it),
against its capacity, which the store sets (``capacities``). A block is valued over the
horizon of the tier it is in (``chance``'s density, ``next_use``'s ``beyond``): a disk tier
sixteen times the memory's keeps a block about sixteen times longer, so what it holds is
worth what comes back within that time, not within the memory's. The first tier's horizon
is the forecast's own, which dates ``value``'s keys.

The victim orders are heaps with lazy re-keying, so that touching a block (every lookup touches a
whole chain) costs no heap operation: a touch only moves a block's keys later. A forecast that
moves a block's next use further ahead (a finish reason, a close) re-files the chain's tails
(``track``), since that moves its key the other way. A popped entry
whose block was touched since is pushed back with its current key; one whose block is no longer
an evictable tail there (pinned, moved, gained a child) is dropped. Whenever a block may have
become an evictable tail (stored, unpinned, lost its last child in the tier) the store calls
``track``.

Stale entries (a block that gained a child or a pin after it was queued: every block of a
stored chain is its tail for an instant) are dropped by compacting a tier's heaps in place
whenever they have doubled since the last compaction: memory stays in proportion to the
candidates, not to every block ever stored, at an amortized constant cost per entry.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable
from typing import Any, overload

import numpy as np
import numpy.typing as npt

from sessioncache.hashing import BlockHash
from sessioncache.store.blocks import BlockMeta
from sessioncache.store.forecast import (
    NO_FORECAST,
    ORPHAN_BASE,
    Forecast,
    Horizon,
    node_forecast,
)

_Entry = tuple[float, int, int, BlockHash]  # (time, touched_by_op, -touch_order, id)
POLICIES = ("forecast", "next_use", "lru")
"""The eviction orders a node may run (``SESSIONCACHE_EVICTION_POLICY``), the default first:
hit density (``forecast.node_forecast``), the former default (``Forecast()``: Belady's rule on
the log-normals' quantiles), LRU."""
_MIN_COMPACT = 4096  # entries a tier's heaps may hold before they are first compacted

Column = npt.NDArray[np.integer[Any]]
"""One number per block (the index's table columns), for the rules over every block at once."""


# -- the rules ---------------------------------------------------------------------------------
#
# Each is written once over a block's numbers (``BlockMeta.standing``), and applies as it is
# to one block (ints) or to every block of the table at once (columns: ``IndexAdoption``).


def may_leave(ref: int, holds: int) -> bool:
    """Whether some copy of a block with ``ref`` references, ``holds`` of them holding the
    block rather than a copy of it (session pins, leases), may leave its tier (a spare one at
    least: ``is_spare``; a tail only unreferenced, ``is_tail``): none while anything else
    references it (a read, a write or a move in flight). The index offers such a block to the
    policy only."""
    return ref == holds


@overload
def is_tail(mask: int, ref: int, here: int, held: int, tier: int, last: bool) -> bool: ...
@overload
def is_tail(
    mask: Column, ref: Column, here: Column, held: Column, tier: int, last: bool
) -> npt.NDArray[np.bool_]: ...
def is_tail(mask: Any, ref: Any, here: Any, held: Any, tier: int, last: bool) -> Any:
    """The tail rule: a block (tier ``mask``, ``ref`` references, ``here`` children held in
    ``tier``, ``held`` children held anywhere) may leave ``tier`` as a victim: unreferenced,
    held there, and no child of it held there; from the ``last`` tier (where a victim is
    dropped, not demoted) also not the last copy of a parent whose child is held elsewhere."""
    tail = (ref == 0) & ((mask >> tier & 1) != 0) & (here == 0)
    if last:
        return tail & ((held == 0) | ((mask & (mask - 1)) != 0))
    return tail


@overload
def is_spare(mask: int, ref: int, holds: int, tier: int) -> bool: ...
@overload
def is_spare(mask: Column, ref: Column, holds: Column, tier: int) -> npt.NDArray[np.bool_]: ...
def is_spare(mask: Any, ref: Any, holds: Any, tier: int) -> Any:
    """A block's copy in ``tier`` is spare: a faster tier holds the block too, and nothing
    references it but what holds the block rather than that copy (``holds``: session pins,
    leases outside the tier whose slots a lease hands out; a read or a move in flight may be
    reading that copy)."""
    return (ref == holds) & ((mask >> tier & 1) != 0) & ((mask & ((1 << tier) - 1)) != 0)


def evictable(meta: BlockMeta, tier: int, *, last: bool = False) -> bool:
    """``is_tail`` of ``meta`` in ``tier``."""
    mask, ref, _, here, held = meta.standing(tier)
    return is_tail(mask, ref, here, held, tier, last)


def spare_copy(meta: BlockMeta, tier: int) -> bool:
    """``is_spare`` of ``meta``'s copy in ``tier``."""
    mask, ref, holds, _, _ = meta.standing(tier)
    return is_spare(mask, ref, holds, tier)


def candidacy(meta: BlockMeta, tier: int, *, last: bool = False) -> tuple[bool, bool]:
    """Whether ``meta``'s copy in ``tier`` is spare, and whether it is an evictable tail
    there: what the policy files it by (``EvictionPolicy.track``)."""
    mask, ref, holds, here, held = meta.standing(tier)
    return is_spare(mask, ref, holds, tier), is_tail(mask, ref, here, held, tier, last)


def lru_key(meta: BlockMeta) -> tuple[float, int, int]:
    """Sort key of LRU order: older first; of one operation's blocks, the deepest first."""
    last_access, _, op, neg_seq, _ = meta.order_keys()
    return (last_access, op, neg_seq)


class EvictionPolicy:
    """TTL first, then the furthest forecast (or LRU) over unpinned chain tails (see module
    docstring). ``forecast=None`` is plain LRU."""

    def __init__(self, num_tiers: int, forecast: Forecast | None = None) -> None:
        self._last = num_tiers - 1
        self.forecast = forecast
        self.capacities = [0] * num_tiers
        """Each tier's capacity in bytes (the store sets them): its horizon's measure."""
        self.horizons: list[Horizon] = []
        """Each tier's turnover (``left``), the horizon a block there is valued over; the
        first tier's is the forecast's own (``Forecast.horizon``), which its keys use."""
        if forecast is not None:
            self.horizons = [forecast.horizon]
            for _ in range(1, num_tiers):
                below = Horizon(forecast.horizon_s)
                below.adapt = False  # the level is the first tier's (``value`` keys)
                self.horizons.append(below)
        self._expiry: list[list[_Entry]] = [[] for _ in range(num_tiers)]
        self._lru: list[list[_Entry]] = [[] for _ in range(num_tiers)]
        self._spare: list[list[_Entry]] = [[] for _ in range(num_tiers)]
        # With a forecast: the tails by next use, furthest first (keys negated).
        self._ahead: list[list[_Entry]] = [[] for _ in range(num_tiers)]
        # ``chance``: per class, the tails by their event's date, oldest first and newest first.
        n = len(forecast.classes) + 1 if forecast is not None and forecast.mode == "chance" else 0
        self._cls: list[list[list[_Entry]]] = [[[] for _ in range(n)] for _ in range(num_tiers)]
        self._new: list[list[list[_Entry]]] = [[[] for _ in range(n)] for _ in range(num_tiers)]
        self._lookup: Callable[[BlockHash], BlockMeta | None] | None = None
        self._limit = [_MIN_COMPACT] * num_tiers

    @classmethod
    def named(cls, name: str, num_tiers: int, forecast: Forecast | None = None) -> EvictionPolicy:
        """The policy a setting names (``POLICIES``)."""
        if name not in POLICIES:
            raise ValueError(f"unknown eviction policy {name!r}; policies are {list(POLICIES)}")
        if name == "lru":
            return cls(num_tiers, None)
        return cls(num_tiers, forecast or (node_forecast() if name == "forecast" else Forecast()))

    def bind(self, lookup: Callable[[BlockHash], BlockMeta | None]) -> None:
        """Let the policy find records by id, so that it can compact its heaps itself."""
        self._lookup = lookup

    def track(self, meta: BlockMeta, tier: int) -> None:
        """Offer ``meta`` as a candidate in ``tier`` if it is an evictable tail or a spare
        copy there."""
        spare, tail = candidacy(meta, tier, last=tier == self._last)
        if not (spare or tail):
            return
        last_access, expires_at, op, neg_seq, next_use = meta.order_keys()
        if spare:
            heapq.heappush(self._spare[tier], (last_access, op, neg_seq, meta.block_hash))
            if self._lookup is not None and self.queued(tier) > self._limit[tier]:
                self.compact(tier, self._lookup)
        if not tail:
            return
        heapq.heappush(self._expiry[tier], (expires_at, op, neg_seq, meta.block_hash))
        heapq.heappush(self._lru[tier], (last_access, op, neg_seq, meta.block_hash))
        if self.forecast is not None:
            heapq.heappush(self._ahead[tier], (-next_use, op, neg_seq, meta.block_hash))
            if self._cls[tier] and NO_FORECAST < next_use < ORPHAN_BASE / 2:
                c = self.forecast.class_of(next_use)
                heapq.heappush(self._cls[tier][c], (next_use, op, neg_seq, meta.block_hash))
                heapq.heappush(self._new[tier][c], (-next_use, op, neg_seq, meta.block_hash))
        if self._lookup is not None and self.queued(tier) > self._limit[tier]:
            self.compact(tier, self._lookup)

    def compact(self, tier: int, lookup: Callable[[BlockHash], BlockMeta | None]) -> None:
        """Drop ``tier``'s stale and duplicate heap entries (keeping, per block, one whose key
        is no later than its current one: a popped entry is re-keyed anyway; by next use, the
        current key)."""
        last = tier == self._last
        heaps = (self._expiry, self._lru, self._spare, self._ahead)
        for kind, heaps_of in enumerate(heaps):
            kept: list[_Entry] = []
            seen: set[BlockHash] = set()
            for entry in heaps_of[tier]:
                block_hash = entry[3]
                if block_hash in seen:
                    continue
                meta = lookup(block_hash)
                if meta is None:
                    continue
                if kind == 2:
                    if not spare_copy(meta, tier):
                        continue
                elif not evictable(meta, tier, last=last):
                    continue
                seen.add(block_hash)
                if kind == 3 and not meta.next_use > NO_FORECAST:
                    heapq.heappush(self._lru[tier], _by_last(meta))  # LRU's order now
                    continue
                # A forecast may have moved either way: file it by its current one.
                kept.append(_by_next_use(meta) if kind == 3 else entry)
            heapq.heapify(kept)
            heaps_of[tier] = kept
        if self._cls[tier]:
            assert self.forecast is not None
            classes: list[list[_Entry]] = [[] for _ in self._cls[tier]]
            newest: list[list[_Entry]] = [[] for _ in self._cls[tier]]
            for key, op, neg_seq, block_hash in self._ahead[tier]:
                if -key < ORPHAN_BASE / 2:
                    c = self.forecast.class_of(-key)
                    classes[c].append((-key, op, neg_seq, block_hash))
                    newest[c].append((key, op, neg_seq, block_hash))
            for heap in (*classes, *newest):
                heapq.heapify(heap)
            self._cls[tier] = classes
            self._new[tier] = newest
        self._limit[tier] = 2 * self.queued(tier) + _MIN_COMPACT

    def next_victim(
        self,
        tier: int,
        now: float,
        lookup: Callable[[BlockHash], BlockMeta | None],
    ) -> BlockMeta | None:
        """Pop the next victim of ``tier``; None when every block there is pinned or a parent.

        The orders in turn (module docstring): expired tails, spare copies, then tails by
        their forecast (or LRU)."""
        last = tier == self._last
        expiry, spare = self._expiry[tier], self._spare[tier]
        for heap in (expiry, spare):
            by_expiry = heap is expiry
            until = now if by_expiry else math.inf  # only the expired leave by expiry
            while heap and heap[0][0] <= until:
                entry = heapq.heappop(heap)
                meta = lookup(entry[3])
                if meta is None or not (
                    evictable(meta, tier, last=last) if by_expiry else spare_copy(meta, tier)
                ):
                    continue  # no longer a candidate there: a stale entry
                last_access, expires_at, op, neg_seq, _ = meta.order_keys()
                time = expires_at if by_expiry else last_access
                current = (time, op, neg_seq, meta.block_hash)
                if current == entry:
                    return meta
                heapq.heappush(heap, current)  # touched since: back in line, later
        lru = self._lru[tier]
        forecast = self.forecast
        if forecast is None:
            oldest = self._top(lru, tier, lookup, _by_last)
            if oldest is not None:
                heapq.heappop(lru)
            return oldest
        if self._cls[tier]:
            return self._by_chance(tier, now, lookup)
        # Two heaps serve the value exactly (``forecast.eviction_value``): blocks with a key
        # by key, the others by last access; the larger value of the two tops goes.
        ahead = self._ahead[tier]
        served = None if forecast.mode == "next_use" else False  # value: keyless ones only
        oldest = self._top(lru, tier, lookup, _by_last, forecast=served)
        coldest = self._top(
            ahead, tier, lookup, _by_next_use, forecast=None if served is None else True
        )
        if coldest is None and oldest is None:
            return None
        if oldest is None or (
            coldest is not None
            and forecast.value(coldest.next_use, coldest.last_access, now, self.horizons[tier])
            > forecast.value(oldest.next_use, oldest.last_access, now, self.horizons[tier])
        ):
            assert coldest is not None
            heapq.heappop(ahead)
            victim = coldest
        else:
            heapq.heappop(lru)
            victim = oldest
        return victim

    def _top(
        self,
        heap: list[_Entry],
        tier: int,
        lookup: Callable[[BlockHash], BlockMeta | None],
        key: Callable[[BlockMeta], _Entry],
        *,
        forecast: bool | None = None,
    ) -> BlockMeta | None:
        """The candidate at the top of ``heap``, left there, once the stale entries above it
        are dropped and the re-keyed ones put back in line. Under a forecast, ``forecast``
        says which blocks the heap serves: those with a key (True) or without (False); a
        block that lost its key (touched) moves to the other heap, one that gained one is
        served by the other heap already (a key is filed there: ``track``)."""
        last = tier == self._last
        while heap:
            entry = heap[0]
            meta = lookup(entry[3])
            if meta is None or not evictable(meta, tier, last=last):
                heapq.heappop(heap)  # no longer a candidate there: a stale entry
                continue
            if forecast is not None and (meta.next_use > NO_FORECAST) != forecast:
                heapq.heappop(heap)
                if forecast:  # touched since it was filed: LRU's order now
                    heapq.heappush(self._lru[tier], _by_last(meta))
                continue
            current = key(meta)
            if current == entry:
                return meta
            heapq.heapreplace(heap, current)  # touched or re-forecast since: back in line
        return None

    def _by_chance(
        self, tier: int, now: float, lookup: Callable[[BlockHash], BlockMeta | None]
    ) -> BlockMeta | None:
        """``chance``: of the tops of the heaps (dead or dated furthest, each class's oldest
        and newest event, the oldest block with no key), the one least likely read within the
        horizon. A class's density rises with silence while its return is still ahead (a
        tool's result takes seconds to come) and falls after it (a heavy tail's hazard does),
        so its least dense block is its oldest or its newest."""
        forecast = self.forecast
        assert forecast is not None
        ahead, lru = self._ahead[tier], self._lru[tier]
        best: BlockMeta | None = None
        heap_of: list[_Entry] | None = None
        top = 0.0
        tops: list[tuple[list[_Entry], BlockMeta | None]] = [
            (ahead, self._top(ahead, tier, lookup, _by_next_use, forecast=True)),
            (lru, self._top(lru, tier, lookup, _by_last, forecast=False)),
        ]
        for c, (oldest, newest) in enumerate(zip(self._cls[tier], self._new[tier], strict=True)):
            tops.append((oldest, self._top_of_class(oldest, c, tier, lookup)))
            tops.append((newest, self._top_of_class(newest, c, tier, lookup, newest=True)))
        for heap, meta in tops:
            if meta is None:
                continue
            value = forecast.value(meta.next_use, meta.last_access, now, self.horizons[tier])
            if best is None or value > top:
                best, heap_of, top = meta, heap, value
        if heap_of is not None:
            heapq.heappop(heap_of)
        return best

    def _top_of_class(
        self,
        heap: list[_Entry],
        c: int,
        tier: int,
        lookup: Callable[[BlockHash], BlockMeta | None],
        *,
        newest: bool = False,
    ) -> BlockMeta | None:
        """``chance``: the candidate of class ``c`` with the oldest event (``newest``: the
        newest), left on ``heap`` (entries of blocks keyed otherwise since are dropped:
        ``track`` filed them there)."""
        forecast = self.forecast
        assert forecast is not None
        last = tier == self._last
        while heap:
            entry = heap[0]
            meta = lookup(entry[3])
            if meta is None or not evictable(meta, tier, last=last):
                heapq.heappop(heap)
                continue
            key = meta.next_use
            if not NO_FORECAST < key < ORPHAN_BASE / 2 or forecast.class_of(key) != c:
                heapq.heappop(heap)
                continue
            _, _, op, neg_seq, _ = meta.order_keys()
            current = (-key if newest else key, op, neg_seq, meta.block_hash)
            if current == entry:
                return meta
            heapq.heapreplace(heap, current)
        return None

    def admits(self, victim: BlockMeta, incoming: BlockMeta, tier: int, now: float) -> bool:
        """Whether ``incoming`` may enter ``tier`` at the cost of ``victim``, the block
        ``next_victim`` chose there (see the module docstring)."""
        if victim.expired(now) or spare_copy(victim, tier):
            return True  # nothing is lost: it expired, or a faster tier holds it too
        if victim.block_hash == incoming.parent and (
            self.forecast is not None or (tier == self._last and len(victim.tiers) == 1)
        ):
            # The only copy of its own parent; under a forecast any copy: the parent is the
            # furthest forecast only when its chain is, and the child is read no sooner.
            return False
        entering = not incoming.mask & ((1 << tier) - 1)  # new or promoted
        return not (entering and _colder(incoming, victim))

    def demotes(self, victim: BlockMeta, tier: int, now: float) -> bool:
        """Whether ``victim``, leaving ``tier``, is copied into the next tier first (else it
        is dropped): unless it is expired, ``tier`` is the last, or another tier holds it."""
        return tier < self._last and not victim.expired(now) and len(victim.tiers) == 1

    def left(self, victim: BlockMeta, tier: int, now: float) -> None:
        """``victim`` left ``tier`` (dropped or demoted; not one kept back): each tier's
        turnover is counted here, once per victim, but for a spare copy's (held in a faster
        tier too: it says nothing of how long the tier keeps a block)."""
        if self.forecast is None or any(t < tier for t in victim.tiers):
            return
        early = None
        if tier == 0:
            key = victim.next_use
            dead = key >= ORPHAN_BASE / 2  # says nothing of the level
            early = -key - now if key > NO_FORECAST and not dead else None
        self.horizons[tier].evicted(victim.nbytes, now, self.capacities[tier], early)

    def queued(self, tier: int) -> int:
        """Heap entries held for ``tier``, stale ones included."""
        return (
            len(self._expiry[tier])
            + len(self._lru[tier])
            + len(self._spare[tier])
            + len(self._ahead[tier])
            + sum(len(heap) for heap in self._cls[tier])
            + sum(len(heap) for heap in self._new[tier])
        )

    def rebuild(self, tier: int, metas: Iterable[BlockMeta]) -> None:
        """Drop stale entries by rebuilding ``tier``'s heaps from the blocks held there."""
        self._expiry[tier] = []
        self._lru[tier] = []
        self._spare[tier] = []
        self._ahead[tier] = []
        self._cls[tier] = [[] for _ in self._cls[tier]]
        self._new[tier] = [[] for _ in self._new[tier]]
        for meta in metas:
            self.track(meta, tier)
        self._limit[tier] = 2 * self.queued(tier) + _MIN_COMPACT


def _by_last(meta: BlockMeta) -> _Entry:
    last_access, _, op, neg_seq, _ = meta.order_keys()
    return (last_access, op, neg_seq, meta.block_hash)


def _by_next_use(meta: BlockMeta) -> _Entry:
    _, _, op, neg_seq, next_use = meta.order_keys()
    return (-next_use, op, neg_seq, meta.block_hash)


def _colder(a: BlockMeta, b: BlockMeta) -> bool:
    """Whether LRU order would evict ``a`` before ``b``."""
    return lru_key(a) < lru_key(b)
