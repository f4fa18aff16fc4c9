"""The store's part of a prefetch: moving a held chain up into the first tier before it is
read, and what the prefetch engine (``sessioncache.sessions.prefetch``) asks of the store to
decide it.

* ``resident(hashes)``: of the held prefix of a chain, how many blocks each tier serves (the
  fastest tier holding each block).
* ``lease(hashes, lease_s, budget)``: the grant. A lease on the held prefix, admitted against
  the tenant's ``PinBudget`` counted as held in the target tier too (the blocks are about to
  be copied there), as a lookup's lease is, but touching nothing: a prefetch is not a read,
  so it moves no block's TTL, LRU order or forecast. ``QuotaExceeded`` when not one block
  fits; the prefix that fits otherwise.
* ``promote(hashes, admits)``: copy each block of the chain held only below the target tier
  into it, root first, evicting there only the victims ``admits`` allows (the engine's rule:
  never a pinned block, never one forecast back sooner); it stops at the first block that
  cannot get room that way. The blocks are leased by the caller, so none of the chain is a
  victim of its own move.
* ``next_victim(tier)``: the tier's next victim, left in line: what a move would evict first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from sessioncache.hashing import BlockHash
from sessioncache.quotas import Counts, PinBudget
from sessioncache.store.blocks import BlockMeta
from sessioncache.store.core import Admits, StorePart
from sessioncache.store.index import Lease, pin_sizes
from sessioncache.tiers.payload import Payload

READ_AHEAD = 8
"""Blocks of a chain a move reads ahead of the one it places (a file each, read at once: a
disk serves several reads at a time far faster than one after another)."""


@dataclass(frozen=True, slots=True)
class Granted:
    """A prefetch's lease: its id, the blocks it holds (a prefix of the chain asked), how many
    of them are below the target tier (to move), and their bytes."""

    lease: Lease
    blocks: int
    below: int
    below_bytes: int


@dataclass(frozen=True, slots=True)
class Moved:
    """What ``promote`` copied up: blocks and bytes; ``complete`` when nothing is left below."""

    blocks: int
    nbytes: int
    complete: bool


class StorePrefetch(StorePart):
    """Chain moves into the first tier (module docstring): ``TieredStore.prefetch``."""

    def resident(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Per tier name (every tier listed), the blocks of the held prefix of ``hashes``
        that it is the fastest to hold."""
        core = self._core
        out = dict.fromkeys(core.tier_index, 0)
        with core.lock:
            run = core.index.held_run(hashes, core.clock.now())
            for name in core.index.names(run, core.fastest_name):
                out[name] += 1
        return out

    def below(self, hashes: Sequence[BlockHash], target: int = 0) -> tuple[int, int, int]:
        """Of the held prefix of ``hashes``: its length, and the blocks and bytes of it not in
        tier ``target``."""
        core = self._core
        with core.lock:
            run = core.index.held_run(hashes, core.clock.now())
            metas = core.index.metas(run, hashes)
            out = [m for m in metas if target not in m.tiers]
            return len(metas), len(out), sum(m.nbytes for m in out)

    def lease(
        self,
        hashes: Sequence[BlockHash],
        lease_s: float,
        budget: PinBudget,
        target: int = 0,
        reserve: Counts | None = None,
    ) -> Granted | None:
        """Lease the held prefix of ``hashes`` for ``lease_s`` as far as ``budget`` admits it
        (with the blocks counted in tier ``target`` too: ``budget.into``); None when nothing
        is held; ``QuotaExceeded`` when not one block fits. Touches nothing. ``reserve``: the
        bytes of the granted blocks not in ``target`` yet are added to the tenant's count
        there, with the grant (the room they will take, which ``budget`` counts as staged)."""
        core = self._core
        if budget.into != target:
            budget = budget._replace(into=target)
        with core.lock:
            now = core.clock.now()
            index = core.index
            index.leases.reap(now)
            run = index.held_run(hashes, now)
            if not len(run):
                return None
            capacity = [t.capacity_bytes for t in core.tiers]
            room = budget.room(index.root_pinned, capacity)
            sizes = pin_sizes(index, run, budget.into)
            fits = budget.admit(sizes, room)
            if not fits:
                raise budget.refuse(sizes[0], room, [t.name for t in core.tiers], capacity)
            metas = index.metas(run.prefix(fits), hashes)
            lease = index.leases.take(metas, now + lease_s)
            below = [m for m in metas if target not in m.tiers]
            nbytes = sum(m.nbytes for m in below)
            if reserve is not None:
                reserve.add(budget.tenant, nbytes)
            return Granted(lease, len(metas), len(below), nbytes)

    def release(self, lease_id: str) -> None:
        """End a prefetch's lease (nothing when it is over already)."""
        with self._core.lock:
            self._core.index.leases.release(lease_id, self._core.clock.now())

    def promote(self, hashes: Sequence[BlockHash], admits: Admits, target: int = 0) -> Moved:
        """Copy the blocks of ``hashes`` (leased by the caller) held only below tier
        ``target`` into it, root first, evicting there what ``admits`` allows; stops at the
        first block not held or that gets no room. The payloads are read ``READ_AHEAD``
        blocks ahead, on threads of the move's own."""
        pool = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="prefetch-read")
        try:
            return self._promote(hashes, admits, target, pool)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _read(self, block_hash: BlockHash, target: int) -> Payload | None:
        """The payload of a block held only below ``target``, from the fastest tier holding
        it (None: it needs no move, or that tier lost it)."""
        core = self._core
        with core.lock:
            meta = core.index.get(block_hash)
            if meta is None or not meta.tiers or min(meta.tiers) <= target:
                return None
            below = min(meta.tiers)
        return core.tiers[below].get(block_hash)

    def _promote(
        self,
        hashes: Sequence[BlockHash],
        admits: Admits,
        target: int,
        pool: ThreadPoolExecutor,
    ) -> Moved:
        core = self._core
        blocks = nbytes = 0
        ahead: deque[Future[Payload | None]] = deque()
        for i in range(min(READ_AHEAD, len(hashes))):
            ahead.append(pool.submit(self._read, hashes[i], target))
        for i, block_hash in enumerate(hashes):
            read = ahead.popleft()
            if i + READ_AHEAD < len(hashes):
                ahead.append(pool.submit(self._read, hashes[i + READ_AHEAD], target))
            with core.lock:
                meta = core.index.get(block_hash)
                if meta is None or not meta.tiers:
                    return Moved(blocks, nbytes, False)
                if target in meta.tiers:
                    continue
                if min(meta.tiers) < target:
                    continue  # a faster tier has it
                core.index.ref(meta, in_flight=True)
            try:
                placed = core.copy_into(meta, target, admits, read.result())
            finally:
                with core.lock:
                    core.index.unref(meta, in_flight=True)
                    if not meta.tiers:
                        core.index.forget(meta)
            if not placed:
                return Moved(blocks, nbytes, False)
            blocks += 1
            nbytes += meta.nbytes
        return Moved(blocks, nbytes, True)

    def next_victim(self, tier: int = 0) -> BlockMeta | None:
        """A snapshot of ``tier``'s next victim, left in line (None: nothing evictable)."""
        core = self._core
        with core.lock:
            victim = core.policy.next_victim(tier, core.clock.now(), core.index.get)
            if victim is None:
                return None
            core.policy.track(victim, tier)
            return core.index.snapshot(victim.block_hash)

    def version(self, tier: int = 0) -> tuple[int, ...]:
        """What changes whenever a move that could not be made may become possible (a block
        stored, moved or evicted, a pin or lease in ``tier`` taken or let go): equal versions,
        equal chances, but for the clock."""
        core = self._core
        with core.lock:
            c = core.counters
            return (
                c.stored_blocks,
                c.evictions,
                c.promotions,
                c.expirations,
                core.index.pinned_bytes[tier],
                len(core.index.leases),
            )

    def free_bytes(self, tier: int = 0) -> int:
        """What ``tier`` can take without evicting."""
        target = self._core.tiers[tier]
        return max(0, min(target.capacity_bytes, self._core.room_of(tier)) - target.used_bytes)
