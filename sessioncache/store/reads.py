"""The store's reads: lookups (and leases), touches, pins, presence and payloads, and where a
leased match lies in the shared-memory tier."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from sessioncache.errors import (
    InvalidInput,
    LeaseNotFound,
)
from sessioncache.hashing import BlockHash, payload_checksum
from sessioncache.quotas import PinBudget, Sizes
from sessioncache.store.blocks import BlockMeta
from sessioncache.store.core import StoreCore, StorePart
from sessioncache.store.index import Run, file_forecast, pin_sizes
from sessioncache.store.recovery import StoreRecovery
from sessioncache.store.results import (
    LocatedSlot,
    Match,
    check_ttl,
)
from sessioncache.tiers.payload import as_memoryview


class StoreReads(StorePart):
    """The store's reads (``TieredStore.reads``): lookups and leases, touches, pins, presence,
    payloads and same-host locates."""

    def __init__(self, core: StoreCore, recovery: StoreRecovery) -> None:
        super().__init__(core)
        self._recovery = recovery

    def lookup(
        self,
        hashes: Sequence[BlockHash],
        *,
        lease_s: float | None = None,
        ttl_s: float | None = None,
        budget: PinBudget | None = None,
        counted: bool = True,
    ) -> Match:
        """The longest held, unexpired prefix of ``hashes``; touches it and optionally leases it.

        ``ttl_s`` raises the TTL of the matched blocks to at least that (a session's TTL).
        ``budget``: a lease is admitted against it (``quotas.PinBudget``): the match is cut to
        the prefix that fits (``Match.cut`` says so), and ``QuotaExceeded`` when not one block
        does. ``counted``: a question an engine asks, counted in the ``lookups``,
        ``hit_blocks`` and ``miss_blocks`` counters; False for the node's own probes (a
        store's plan) and for fetches of blocks a counted question already asked for (loads).
        """
        if lease_s is not None and not 0 < lease_s <= self._core.max_lease_s:
            raise InvalidInput(f"lease_s must be in (0, {self._core.max_lease_s}], got {lease_s}")
        if ttl_s is not None:
            check_ttl(ttl_s)
        with self._core.lock:
            now = self._core.clock.now()
            self._core.index.leases.reap(now)
            matched = self._core.index.held_run(hashes, now)
            short = len(matched) < len(hashes)
            if not (short and (self._core.shared is not None or self._recovery.scanning())):
                return self._finish_lookup(hashes, matched, now, lease_s, ttl_s, budget, counted)
        # The run indexed here stops short: the rest may be held elsewhere (outside the lock).
        self._adopt_elsewhere(hashes, len(matched), now)
        with self._core.lock:
            now = self._core.clock.now()
            matched = self._core.index.held_run(hashes, now)
            return self._finish_lookup(hashes, matched, now, lease_s, ttl_s, budget, counted)

    def touch(self, hashes: Sequence[BlockHash], ttl_s: float | None = None) -> int:
        """Touch the held, unexpired prefix of ``hashes`` as a lookup does (sliding TTL, raised
        to at least ``ttl_s``; LRU order; observers told), but count no lookup nor hit, lease
        nothing and never ask the shared tier: for noting activity on blocks an engine has
        already looked up (a session's chain). Returns how many blocks were touched."""
        if ttl_s is not None:
            check_ttl(ttl_s)
        with self._core.lock:
            now = self._core.clock.now()
            self._core.index.leases.reap(now)  # as a lookup does: leases over unpin on time
            matched = self._core.index.held_run(hashes, now)
            self._core.index.touch_run(matched, now, ttl_s, hit=False)
            self._core.notify_touched(matched, hashes)
            return len(matched)

    def _finish_lookup(
        self,
        hashes: Sequence[BlockHash],
        matched: Run,
        now: float,
        lease_s: float | None,
        ttl_s: float | None,
        budget: PinBudget | None,
        counted: bool,
    ) -> Match:
        """Count (when ``counted``), touch and lease a lookup's match, cut to what ``budget``
        admits (lock held)."""
        cut = None
        if lease_s is not None and budget is not None and len(matched):
            fits = self._admitted(budget, matched)
            if fits < len(matched):
                matched, cut = matched.prefix(fits), "pin_share"
        n = len(matched)
        if counted:
            self._count(n, len(hashes) - n)
        self._core.index.touch_run(matched, now, ttl_s)
        self._core.notify_touched(matched, hashes)
        lease = None
        if lease_s is not None and n:
            lease = self._core.index.leases.take(
                self._core.index.metas(matched, hashes), now + lease_s
            )
        return Match(
            list(hashes[:n]),  # the matched run is a prefix of the ids asked
            self._core.index.names(matched, self._core.fastest_name),
            lease,
            cut,
        )

    def _count(self, hit: int, miss: int) -> None:
        """One lookup an engine asked, of ``hit`` blocks held and ``miss`` not (lock held)."""
        counters = self._core.counters
        counters.lookups += 1
        counters.hit_blocks += hit
        counters.miss_blocks += miss

    def _admitted(self, budget: PinBudget, run: Run, *, refuse: bool = True) -> int:
        """How many blocks of ``run``, from the first, ``budget`` admits a lasting pin of (lock
        held); with ``refuse``, ``QuotaExceeded`` when not one does."""
        room, capacity = self._room(budget)
        sizes = pin_sizes(self._core.index, run, budget.into)
        fits = budget.admit(sizes, room)
        if not fits and refuse:
            raise budget.refuse(sizes[0], room, [t.name for t in self._core.tiers], capacity)
        return fits

    def _room(self, budget: PinBudget) -> tuple[Sizes, list[int]]:
        """``budget``'s room per tier, and the tiers' capacities (lock held)."""
        capacity = [t.capacity_bytes for t in self._core.tiers]
        return budget.room(self._core.index.root_pinned, capacity), capacity

    def adopt_elsewhere(self, hashes: Sequence[BlockHash]) -> int:
        """Index what is held of ``hashes`` past the run indexed here, as ``lookup`` does
        when its run stops short: for questions by ids, which are proved against the index
        afterwards. How many were adopted."""
        if not hashes:
            return 0
        with self._core.lock:
            now = self._core.clock.now()
            held = len(self._core.index.held_run(hashes, now))
        if held == len(hashes):
            return 0
        return self._adopt_elsewhere(hashes, held, now)

    def _adopt_elsewhere(self, hashes: Sequence[BlockHash], start: int, now: float) -> int:
        """Where the run indexed here stops short: a durable tier still walking its folders
        after a fast restart (files the catalog lacked), then the fleet's shared tier (a chain
        another node stored: one round trip), outside the lock. How many were adopted."""
        adopted = self._recovery.adopt_unscanned(hashes[start:])
        if self._core.shared is not None:
            if adopted:
                with self._core.lock:
                    now = self._core.clock.now()
                    start = len(self._core.index.held_run(hashes, now))
            if start < len(hashes):
                adopted += self._adopt_shared(hashes, start, now)
        return adopted

    def _adopt_shared(self, hashes: Sequence[BlockHash], start: int, now: float) -> int:
        """Index the blocks of ``hashes[start:]`` that the shared tier holds, as far as they
        continue the chain; returns how many were adopted."""
        assert self._core.shared is not None
        index, tier = self._core.shared
        found = tier.locate_many(hashes[start:])
        adopted = 0
        with self._core.lock:
            parent = hashes[start - 1] if start else None
            for block_hash, remote in zip(hashes[start:], found, strict=False):
                if remote is None or (start + adopted and remote.parent != parent):
                    break
                if remote.expires_at is None or remote.expires_at <= now:
                    break
                meta = self._core.index.adoption.located(
                    block_hash, remote, now, self._core.default_ttl
                )
                self._core.payload_sizes.setdefault(remote.namespace_root, remote.nbytes)
                self._core.add_to_tier(meta, index)
                parent = block_hash
                adopted += 1
        return adopted

    def release(self, lease_id: str) -> None:
        """Unpin a lease's blocks; raises ``LeaseNotFound`` if it is unknown or already over
        (past its expiry, even if not reaped yet: then it is released all the same). A release
        that does not raise therefore means the blocks stayed pinned since the lookup: the
        same-host path relies on it (a reader that copied under an expired lease discards)."""
        with self._core.lock:
            if not self._core.index.leases.release(lease_id, self._core.clock.now()):
                raise LeaseNotFound(f"no live lease {lease_id!r}")

    def lease_hashes(self, lease_id: str) -> tuple[BlockHash, ...] | None:
        """The blocks a lease pins; None when there is no such lease (any more)."""
        with self._core.lock:
            lease = self._core.index.leases.find(lease_id)
            return lease.hashes if lease is not None else None

    def forecast(
        self, hashes: Sequence[BlockHash], next_use: float | None, *, past_forks: bool = False
    ) -> int:
        """Predict the held prefix of ``hashes`` (a session's chain) read again at
        ``next_use``, or (None) never; ``past_forks``: only past the last fork
        (``index.file_forecast``). No touch. Returns how
        many blocks it covered."""
        if not hashes:
            return 0
        with self._core.lock:
            index = self._core.index
            run = index.held_run(hashes, self._core.clock.now())
            file_forecast(index, run, next_use, past_forks=past_forks)
            return len(run)

    def pin(self, hashes: Sequence[BlockHash], budget: PinBudget | None = None) -> list[BlockHash]:
        """Pin the longest held prefix of ``hashes`` (a live session's chain: blocks past a
        hole are useless), of it only what ``budget`` admits (``quotas.PinBudget``); returns
        the pinned ids, exactly what ``unpin`` must be given."""
        with self._core.lock:
            if budget is None:
                return self._core.index.pin(hashes)
            return self._core.index.pin(
                hashes, lambda run: self._admitted(budget, run, refuse=False)
            )

    def hold(self, budget: PinBudget, tier: str, nbytes: int, blocks: int) -> int:
        """Admit ``blocks`` blocks of ``nbytes`` in ``tier`` that the tenant holds outside the
        index (a same-host staging's slots) against ``budget``, under the lock the index's
        pins are admitted under: those that fit are counted in its ``staged``
        (``quotas.PinBudget``). Returns how many fit."""
        sizes = np.zeros((blocks, len(self._core.tiers)), np.int64)
        sizes[:, self._core.tier_index[tier]] = nbytes
        with self._core.lock:
            fits = budget.admit(sizes, self._room(budget)[0])
            if budget.staged is not None:
                budget.staged.add(budget.tenant, fits * nbytes)
            return fits

    def unpin(self, hashes: Sequence[BlockHash]) -> None:
        """Undo ``pin`` for the same ids."""
        with self._core.lock:
            self._core.index.unpin(hashes)

    def pinned_under(self, roots: Iterable[bytes]) -> list[int]:
        """Bytes of pinned blocks per tier (leases, sessions, moves) under ``roots``: one
        tenant's share when they are its namespace roots."""
        total = [0] * len(self._core.tiers)
        with self._core.lock:
            pinned = self._core.index.root_pinned
            for root in roots:
                for tier, n in enumerate(pinned.get(root, ())):
                    total[tier] += n
        return total

    def chain_to(self, head: BlockHash) -> list[BlockHash]:
        """The held chain ending at ``head``, root first, following parents while they are
        held (empty when ``head`` is not)."""
        with self._core.lock:
            return self._core.index.chain_to(head)

    def chain_tiers(self, head: BlockHash) -> list[tuple[BlockMeta, list[str]]]:
        """The held chain ending at ``head`` (root first) as record snapshots with the names
        of the tiers holding each block, fastest first: one pass under the lock."""
        with self._core.lock:
            out = []
            for block_hash in self._core.index.chain_to(head):
                meta = self._core.index.snapshot(block_hash)
                if meta is not None:
                    out.append((meta, [self._core.tiers[t].name for t in sorted(meta.tiers)]))
            return out

    def holdings(self) -> list[tuple[BlockHash, str, float]]:
        """``(id, tier name, expires_at)`` of every held copy (the fleet index republishes
        these when it re-registers)."""
        with self._core.lock:
            return [
                (meta.block_hash, self._core.tiers[tier].name, meta.expires_at)
                for meta in self._core.index.records()
                for tier in meta.tiers
            ]

    def contains(self, block_hash: BlockHash) -> bool:
        return self.contains_many([block_hash])[0]

    def contains_many(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """For each id, whether a tier holds it unexpired (one pass under the lock)."""
        with self._core.lock:
            now = self._core.clock.now()
            return [self._core.index.held(block_hash, now) is not None for block_hash in hashes]

    def held_under(
        self, namespace_root: bytes, hashes: Sequence[BlockHash], *, counted: bool = False
    ) -> list[bool]:
        """For each id, whether a tier holds it unexpired under ``namespace_root`` (one pass
        under the lock; nothing touched): the presence test of keyed blocks. ``counted``: a
        question an engine asks (an exists), counted as one lookup as ``lookup`` counts one,
        its held ids as hit blocks and the others as miss blocks."""
        with self._core.lock:
            now = self._core.clock.now()
            out = []
            for block_hash in hashes:
                meta = self._core.index.held(block_hash, now)
                out.append(meta is not None and meta.namespace_root == namespace_root)
            if counted:
                hit = sum(out)
                self._count(hit, len(out) - hit)
            return out

    def where(self, block_hash: BlockHash) -> list[str]:
        """Names of the tiers holding the block, fastest first."""
        with self._core.lock:
            meta = self._core.index.get(block_hash)
            return [] if meta is None else [self._core.tiers[t].name for t in sorted(meta.tiers)]

    def meta(self, block_hash: BlockHash) -> BlockMeta | None:
        """A snapshot of the block's record (for the catalog and tests)."""
        with self._core.lock:
            return self._core.index.snapshot(block_hash)

    def get(self, block_hash: BlockHash, *, promote: bool | None = None) -> torch.Tensor:
        """The block's payload as a 1-D uint8 tensor; raises ``BlockNotFound``.

        The tensor may be a view into tier memory: it stays valid while the block is held in
        that tier, which a lease guarantees. ``get_bytes`` returns a copy instead.
        """
        with self._core.pinned_for_read(block_hash) as meta:
            return self._core.read(meta, promote)

    def get_bytes(self, block_hash: BlockHash, *, promote: bool | None = None) -> bytes:
        """A copy of the block's payload, taken while the block is pinned."""
        with self._core.pinned_for_read(block_hash) as meta:
            data = self._core.read(meta, promote)
            return bytes(as_memoryview(data))

    def locate(self, hashes: Sequence[BlockHash]) -> list[LocatedSlot]:
        """Where each block of ``hashes`` lies in the shared-memory tier, with its checksum,
        as far as the run goes: the caller holds a lease on them (``lookup(..., lease_s=)``),
        which keeps each slot from reuse until it is released or expires.

        A block held only in other tiers is copied into the shared-memory tier first (making
        room there as a put does); the answer stops at the first block that is not pinned,
        that no tier can read, or that cannot be given room there (everything pinned).
        """
        shm_index, tier = self._core.require_shm()
        located: list[LocatedSlot] = []
        for block_hash in hashes:
            with self._core.lock:
                meta = self._core.index.get(block_hash)
                if meta is None or not meta.tiers or not meta.ref_cnt:
                    break
            location = tier.locate(block_hash)
            if location is None:
                if not self._core.copy_into(meta, shm_index):
                    break
                location = tier.locate(block_hash)
                if location is None:
                    break
            with self._core.lock:
                if not meta.live:  # the lease lapsed and the record went meanwhile
                    break
                checksum = meta.checksum
                self._core.counters.loaded_bytes += meta.nbytes  # the engine maps and reads it
            if checksum is None:
                view = self._core.tiers[shm_index].get(block_hash)
                if view is None:
                    break
                checksum = payload_checksum(as_memoryview(view))
                with self._core.lock:
                    if not meta.live:
                        break
                    meta.checksum = checksum
            located.append(LocatedSlot(block_hash, location, checksum))
        return located
