"""The tiered block store: one index over a stack of tiers, fastest first.

Data flow (``docs/architecture.md`` has the pictures):

* ``lookup(hashes)`` walks the chain from its root and stops at the first block that is not
  held or has expired; it touches the matched prefix (sliding TTL, LRU order) and optionally
  leases it, so that it cannot be evicted between the lookup and the load. Counted in the
  ``lookups`` and ``hit_blocks`` counters: it is what engines ask. ``touch(hashes)`` touches
  the same prefix without counting (a session noting activity on blocks already looked up).
* ``put(hashes, payloads, parent=...)`` stores a chain segment into the first tier (or the
  one named). A full tier makes room by evicting victims chosen by the ``EvictionPolicy``;
  a victim is demoted to the next tier (write-back) unless it has expired or the tier is the
  last, where it is dropped. ``durable=True`` also writes through to the first durable tier
  before returning.
* ``get(hash)`` reads from the fastest tier holding the block and, when configured, copies a
  hit from a lower tier up into the first tier (promotion).

The store orchestrates: tiers, moves between them, observers, counters. What it knows of the
blocks (records, chain links, per-tier counts, pins, leases) is the ``BlockIndex``
(``sessioncache/index.py``); who leaves a full tier and who may enter it, the
``EvictionPolicy`` (``sessioncache/policy.py``).

Threading model: one re-entrant lock guards the index (block records, leases, policy heaps,
counters). Payload copies and file I/O run outside it, so that a put demoting a block to disk
never stalls lookups; a block being copied holds a transient pin (``ref_cnt``), and a block
being stored is invisible to lookups until its first tier has the whole payload. Tiers are
themselves thread-safe; the store never calls back into itself from a tier, so the lock order
is always store, then tier.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from sessioncache.blocks import BlockMeta
from sessioncache.clock import Clock, SystemClock
from sessioncache.errors import (
    BlockNotFound,
    InvalidInput,
    LeaseNotFound,
    PayloadSizeError,
    TierFull,
    UnknownTier,
)
from sessioncache.events import StoreObserver
from sessioncache.hashing import HASH_BYTES, BlockHash
from sessioncache.index import BlockIndex, Lease
from sessioncache.policy import EvictionPolicy
from sessioncache.tiers.base import CheckedTier, RecoverableTier, SharedTier, Tier
from sessioncache.tiers.payload import Payload, as_memoryview, payload_nbytes

log = logging.getLogger("sessioncache.store")

DEFAULT_TTL_S = 3 * 24 * 3600.0
"""Blocks stored without a TTL live three days past their last access (the agent default)."""

_PLACE_ATTEMPTS = 8


class Match(NamedTuple):
    """The longest cached prefix of a lookup."""

    hashes: list[BlockHash]
    """The matched ids, root first."""
    tiers: list[str]
    """For each matched block, the fastest tier holding it."""
    lease: Lease | None

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)


class PutResult(NamedTuple):
    """What a ``put`` did with each block of the segment."""

    stored: list[BlockHash]
    """Newly written by this call."""
    present: list[BlockHash]
    """Already held (their TTL was extended) or being stored by another caller."""
    dropped: list[BlockHash]
    """Not stored: no tier could make room (everything pinned) or the payload fits nowhere."""


@dataclass(frozen=True, slots=True)
class TierStats:
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    durable: bool
    pinned_bytes: int


@dataclass(slots=True)
class Counters:
    lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    puts: int = 0
    stored_blocks: int = 0
    dropped_blocks: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    expirations: int = 0
    corrupt_reads: int = 0


@dataclass(frozen=True, slots=True)
class StoreStats:
    tiers: list[TierStats]
    blocks: int
    pinned_blocks: int
    leases: int
    counters: Counters = field(default_factory=Counters)


class TieredStore:
    """A content-addressed block store over ``tiers`` (fastest first); see the module doc."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        policy: EvictionPolicy | None = None,
        *,
        clock: Clock | None = None,
        default_ttl_s: float = DEFAULT_TTL_S,
        promote_on_get: bool = True,
        max_lease_s: float = 3600.0,
        observers: Sequence[StoreObserver] = (),
        write_through: Sequence[str] = (),
    ) -> None:
        if not tiers:
            raise InvalidInput("a store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise InvalidInput(f"tier names must be unique, got {names}")
        _check_ttl(default_ttl_s)
        self._tiers = list(tiers)
        self._tier_index = {name: i for i, name in enumerate(names)}
        self._policy = policy or EvictionPolicy(len(self._tiers))
        self._clock: Clock = clock or SystemClock()
        self._default_ttl = default_ttl_s
        self._promote = promote_on_get
        self._max_lease_s = max_lease_s
        self._lock = threading.RLock()
        self._index = BlockIndex(len(self._tiers), self._policy)
        self._payload_sizes: dict[bytes, int] = {}
        self._promoting: set[BlockHash] = set()
        self._observers = list(observers)
        # The fleet's shared tier (at most one): looked up on local misses, and never
        # trimmed by this node's expiry sweep (its keys expire in the shared server itself).
        shared = [(i, t) for i, t in enumerate(self._tiers) if isinstance(t, SharedTier)]
        if len(shared) > 1:
            raise InvalidInput("a store takes at most one shared tier")
        self._shared: tuple[int, SharedTier] | None = shared[0] if shared else None
        self._write_through = sorted({self._tier_by_name(name) for name in write_through})
        self._counters = Counters()
        self._adopt_recovered()

    # -- public API ---------------------------------------------------------------------

    @property
    def tiers(self) -> list[Tier]:
        return list(self._tiers)

    @property
    def clock(self) -> Clock:
        return self._clock

    def tier_names(self) -> list[str]:
        return list(self._tier_index)

    def lookup(
        self,
        hashes: Sequence[BlockHash],
        *,
        lease_s: float | None = None,
        ttl_s: float | None = None,
    ) -> Match:
        """The longest held, unexpired prefix of ``hashes``; touches it and optionally leases it.

        ``ttl_s`` raises the TTL of the matched blocks to at least that (a session's TTL).
        """
        if lease_s is not None and not 0 < lease_s <= self._max_lease_s:
            raise InvalidInput(f"lease_s must be in (0, {self._max_lease_s}], got {lease_s}")
        if ttl_s is not None:
            _check_ttl(ttl_s)
        with self._lock:
            now = self._clock.now()
            self._index.reap_leases(now)
            matched = self._index.held_prefix(hashes, now)
            short = len(matched) < len(hashes) and self._shared is not None
            if not short:
                return self._finish_lookup(hashes, matched, now, lease_s, ttl_s)
        # Local tiers stop short: the fleet's shared tier may hold the rest of the chain,
        # stored by another node. One round trip, outside the lock.
        self._adopt_shared(hashes, len(matched), now)
        with self._lock:
            now = self._clock.now()
            return self._finish_lookup(
                hashes, self._index.held_prefix(hashes, now), now, lease_s, ttl_s
            )

    def touch(self, hashes: Sequence[BlockHash], ttl_s: float | None = None) -> int:
        """Touch the held, unexpired prefix of ``hashes`` as a lookup does (sliding TTL, raised
        to at least ``ttl_s``; LRU order; observers told), but count no lookup nor hit, lease
        nothing and never ask the shared tier: for noting activity on blocks an engine has
        already looked up (a session's chain). Returns how many blocks were touched."""
        if ttl_s is not None:
            _check_ttl(ttl_s)
        with self._lock:
            now = self._clock.now()
            self._index.reap_leases(now)  # as a lookup does: leases over unpin on time
            matched = self._index.held_prefix(hashes, now)
            self._index.touch_chain(matched, now, ttl_s, hit=False)
            self._notify_touched(matched)
            return len(matched)

    def _finish_lookup(
        self,
        hashes: Sequence[BlockHash],
        matched: list[BlockMeta],
        now: float,
        lease_s: float | None,
        ttl_s: float | None,
    ) -> Match:
        """Count, touch and lease a lookup's match (lock held)."""
        self._counters.lookups += 1
        self._counters.hit_blocks += len(matched)
        self._counters.miss_blocks += len(hashes) - len(matched)
        self._index.touch_chain(matched, now, ttl_s)
        self._notify_touched(matched)
        lease = None
        if lease_s is not None and matched:
            lease = self._index.lease(matched, now + lease_s)
        return Match(
            [m.block_hash for m in matched],
            [self._tiers[min(m.tiers)].name for m in matched],
            lease,
        )

    def _adopt_shared(self, hashes: Sequence[BlockHash], start: int, now: float) -> int:
        """Index the blocks of ``hashes[start:]`` that the shared tier holds, as far as they
        continue the chain; returns how many were adopted."""
        assert self._shared is not None
        index, tier = self._shared
        found = tier.locate_many(hashes[start:])
        adopted = 0
        with self._lock:
            parent = hashes[start - 1] if start else None
            for block_hash, remote in zip(hashes[start:], found, strict=False):
                if remote is None or (start + adopted and remote.parent != parent):
                    break
                if remote.expires_at is None or remote.expires_at <= now:
                    break
                meta = self._index.adopt_located(block_hash, remote, now, self._default_ttl)
                self._payload_sizes.setdefault(remote.namespace_root, remote.nbytes)
                self._add_to_tier(meta, index)
                parent = block_hash
                adopted += 1
        return adopted

    def release(self, lease_id: str) -> None:
        """Unpin a lease's blocks; raises ``LeaseNotFound`` if it is unknown or already over."""
        with self._lock:
            if not self._index.release(lease_id):
                raise LeaseNotFound(f"no live lease {lease_id!r}")

    def pin(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Pin the longest held prefix of ``hashes`` (a live session's chain: blocks past a
        hole are useless); returns the pinned ids, exactly what ``unpin`` must be given."""
        with self._lock:
            return self._index.pin(hashes)

    def unpin(self, hashes: Sequence[BlockHash]) -> None:
        """Undo ``pin`` for the same ids."""
        with self._lock:
            self._index.unpin(hashes)

    def chain_to(self, head: BlockHash) -> list[BlockHash]:
        """The held chain ending at ``head``, root first, following parents while they are
        held (empty when ``head`` is not)."""
        with self._lock:
            return self._index.chain_to(head)

    def holdings(self) -> list[tuple[BlockHash, str, float]]:
        """``(id, tier name, expires_at)`` of every held copy (the fleet index republishes
        these when it re-registers)."""
        with self._lock:
            return [
                (meta.block_hash, self._tiers[tier].name, meta.expires_at)
                for meta in self._index.records()
                for tier in meta.tiers
            ]

    def contains(self, block_hash: BlockHash) -> bool:
        return self.contains_many([block_hash])[0]

    def contains_many(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """For each id, whether a tier holds it unexpired (one pass under the lock)."""
        with self._lock:
            now = self._clock.now()
            return [self._index.held(block_hash, now) is not None for block_hash in hashes]

    def where(self, block_hash: BlockHash) -> list[str]:
        """Names of the tiers holding the block, fastest first."""
        with self._lock:
            meta = self._index.get(block_hash)
            return [] if meta is None else [self._tiers[t].name for t in sorted(meta.tiers)]

    def meta(self, block_hash: BlockHash) -> BlockMeta | None:
        """A snapshot of the block's record (for the catalog and tests)."""
        with self._lock:
            return self._index.snapshot(block_hash)

    def get(self, block_hash: BlockHash, *, promote: bool | None = None) -> torch.Tensor:
        """The block's payload as a 1-D uint8 tensor; raises ``BlockNotFound``.

        The tensor may be a view into tier memory: it stays valid while the block is held in
        that tier, which a lease guarantees. ``get_bytes`` returns a copy instead.
        """
        with self._pinned_for_read(block_hash) as meta:
            return self._read(meta, promote)

    def get_bytes(self, block_hash: BlockHash, *, promote: bool | None = None) -> bytes:
        """A copy of the block's payload, taken while the block is pinned."""
        with self._pinned_for_read(block_hash) as meta:
            data = self._read(meta, promote)
            return bytes(as_memoryview(data))

    def counters(self) -> Counters:
        """A snapshot of the event counters."""
        with self._lock:
            return replace(self._counters)

    def _read(self, meta: BlockMeta, promote: bool | None) -> torch.Tensor:
        block_hash = meta.block_hash
        promote = self._promote if promote is None else promote
        while True:
            with self._lock:
                if not meta.tiers:
                    raise BlockNotFound(f"block {block_hash.hex()} is not held")
                tier = min(meta.tiers)
            source = self._tiers[tier]
            data = source.get(block_hash)
            if data is not None:
                break
            if isinstance(source, CheckedTier) and source.problem() is not None:
                # Unreachable, not lost (a Redis outage): keep the record, read nothing.
                raise BlockNotFound(f"block {block_hash.hex()}: tier {source.name} is down")
            # The tier lost it (a corrupt file is quarantined, a shared key expired or was
            # evicted by its server): forget that copy, try lower.
            with self._lock:
                self._counters.corrupt_reads += 1
                self._drop_from_tier(meta, tier)
        if promote and tier > 0:
            with self._lock:
                first = block_hash not in self._promoting
                self._promoting.add(block_hash)
            if first:
                try:
                    if self._place(meta, data, 0, stop=tier) is not None:
                        with self._lock:
                            self._counters.promotions += 1
                finally:
                    with self._lock:
                        self._promoting.discard(block_hash)
        return data

    def put(
        self,
        hashes: Sequence[BlockHash],
        payloads: Sequence[Payload],
        *,
        namespace_root: bytes,
        parent: BlockHash | None = None,
        ttl_s: float | None = None,
        tier: str | None = None,
        durable: bool = False,
    ) -> PutResult:
        """Store a chain segment: ``hashes[0]``'s parent is ``parent`` (None at a chain root).

        Every payload of one namespace must have the same size; a mismatch raises
        ``PayloadSizeError`` before anything is written.
        """
        start = self._tier_by_name(tier) if tier is not None else 0
        ttl = self._default_ttl if ttl_s is None else _check_ttl(ttl_s)
        sizes = self._validate_segment(hashes, payloads, namespace_root, parent)
        durable_tier = self._first_durable(start) if durable else None
        if durable and durable_tier is None:
            raise InvalidInput("durable=True but no durable tier at or below the target tier")
        result = PutResult([], [], [])
        prev = parent
        with self._lock:
            op = self._index.next_op()
        for i, (block_hash, payload, nbytes) in enumerate(
            zip(hashes, payloads, sizes, strict=True)
        ):
            if result.dropped:
                # The rest hangs off a dropped block: unreachable, so not worth any room.
                result.dropped.extend(hashes[i:])
                break
            meta = self._claim(block_hash, prev, namespace_root, nbytes, ttl, op)
            prev = block_hash
            if meta is None:
                result.present.append(block_hash)
                continue
            try:
                # By default no faster than its parent: a fast tier holds the heads of chains,
                # which then leave it tail first, as they leave the store.
                with self._lock:
                    target = (
                        start if tier is not None else max(start, self._index.parent_tier(meta))
                    )
                placed = self._place(meta, payload, target)
                if placed is not None:
                    also = [t for t in self._write_through if t != placed]
                    if durable_tier is not None and durable_tier != placed:
                        also.append(durable_tier)
                    for extra in also:
                        self._place(meta, payload, extra, stop=extra + 1)
            finally:
                with self._lock:
                    self._index.unref(meta)
                    if not meta.tiers:
                        self._index.forget(meta)
            if placed is None:
                result.dropped.append(block_hash)
            else:
                result.stored.append(block_hash)
        with self._lock:
            self._counters.puts += 1
            self._counters.stored_blocks += len(result.stored)
            self._counters.dropped_blocks += len(result.dropped)
        return result

    def delete(self, hashes: Sequence[BlockHash]) -> int:
        """Drop unpinned blocks from every tier; returns how many were dropped."""
        dropped = 0
        with self._lock:
            for block_hash in hashes:
                meta = self._index.get(block_hash)
                if meta is None or meta.ref_cnt:
                    continue
                for tier in sorted(meta.tiers):
                    self._drop_from_tier(meta, tier)
                dropped += 1
        return dropped

    def expire(self) -> int:
        """Drop every unpinned expired block from every tier; returns how many (the sweep)."""
        with self._lock:
            now = self._clock.now()
            self._index.reap_leases(now)
            victims = self._index.expired_unpinned(now)
            shared = self._shared[0] if self._shared is not None else -1
            for meta in victims:
                for tier in sorted(meta.tiers):
                    # Another node may have extended a shared key: let the server expire it.
                    self._drop_from_tier(meta, tier, delete=tier != shared)
            self._counters.expirations += len(victims)
            return len(victims)

    def stats_tiers(self) -> list[TierStats]:
        """Per-tier figures only: cheap enough for every request."""
        with self._lock:
            return [
                TierStats(t.name, t.capacity_bytes, t.used_bytes, n, t.durable, pinned)
                for t, n, pinned in zip(
                    self._tiers, self._index.tier_blocks, self._index.pinned_bytes, strict=True
                )
            ]

    def stats(self) -> StoreStats:
        with self._lock:
            self._index.reap_leases(self._clock.now())
            return StoreStats(
                tiers=self.stats_tiers(),
                blocks=self._index.held_count(),
                pinned_blocks=self._index.pinned_count(),
                leases=self._index.lease_count(),
                counters=replace(self._counters),
            )

    def close(self) -> None:
        for tier in self._tiers:
            tier.close()

    # -- placement and eviction ---------------------------------------------------------

    def _place(
        self, meta: BlockMeta, payload: Payload, start: int, *, stop: int | None = None
    ) -> int | None:
        """Write ``payload`` into the first tier at or after ``start`` (before ``stop``) that
        can make room, evicting there as needed; returns that tier's index or None."""
        end = len(self._tiers) if stop is None else stop
        for tier in range(start, end):
            if tier in meta.tiers:
                return tier
            if meta.nbytes > self._tiers[tier].capacity_bytes:
                continue
            for _ in range(_PLACE_ATTEMPTS):
                if self._tiers[tier].fits(meta.nbytes):
                    try:
                        self._tiers[tier].put(
                            meta.block_hash,
                            payload,
                            meta.namespace_root,
                            parent=meta.parent,
                            expires_at=meta.expires_at,
                        )
                    except TierFull:
                        continue  # another thread took the room: evict again
                    with self._lock:
                        self._add_to_tier(meta, tier)
                    return tier
                if not self._evict_one(tier, meta):
                    break
        return None

    def _evict_one(self, tier: int, incoming: BlockMeta) -> bool:
        """Move one victim out of ``tier`` to admit ``incoming``: demote it, or drop it if
        expired, at the bottom or a spare copy. Refuses (False) when nothing is evictable or
        when the policy does not admit ``incoming`` at the cost of the victim (see
        ``EvictionPolicy.admits``): then ``incoming`` belongs lower down, or nowhere."""
        with self._lock:
            now = self._clock.now()
            victim = self._policy.next_victim(tier, now, self._index.get)
            if victim is None:
                return False
            if not self._policy.admits(victim, incoming, tier, now):
                self._policy.track(victim, tier)  # not evicted: back in line
                return False
            self._counters.evictions += 1
            below = tier + 1 < len(self._tiers) and not victim.expired(now)
            if not below or len(victim.tiers) > 1:
                # Expired, last tier, or held in another tier too: nothing to copy.
                if victim.expired(now):
                    self._counters.expirations += 1
                self._drop_from_tier(victim, tier)
                return True
            self._index.ref(victim)  # in flight: no other thread may pick or drop it
        try:
            data = self._tiers[tier].get(victim.block_hash)
            if data is not None and self._place(victim, data, tier + 1) is not None:
                with self._lock:
                    self._counters.demotions += 1
        finally:
            with self._lock:
                # Keep the copy of a block someone pinned meanwhile (a lease taken while it
                # was in flight may be reading it), even when it found room below.
                if victim.ref_cnt == 1:
                    self._drop_from_tier(victim, tier)
                self._index.unref(victim)
                if not victim.tiers:
                    self._index.forget(victim)
        return True

    # -- index changes that tiers and observers hear of (lock held) ----------------------

    def _claim(
        self,
        block_hash: BlockHash,
        parent: BlockHash | None,
        namespace_root: bytes,
        nbytes: int,
        ttl: float,
        op: int,
    ) -> BlockMeta | None:
        """Create the record of a block about to be stored, pinned while in flight; None when
        it is already held (its TTL is extended) or another caller is storing it."""
        with self._lock:
            now = self._clock.now()
            meta = self._index.get(block_hash)
            if meta is not None:
                if meta.tiers:
                    self._index.touch(meta, now, ttl, op)
                    self._notify_touched([meta])
                return None
            return self._index.new_record(
                block_hash,
                parent=parent,
                namespace_root=namespace_root,
                nbytes=nbytes,
                ttl_s=ttl,
                created=now,
                ref_cnt=1,
                touched_by_op=op,
            )

    def _add_to_tier(self, meta: BlockMeta, tier: int) -> None:
        if self._index.add_copy(meta, tier):
            for observer in self._observers:
                observer.block_added(meta, self._tiers[tier].name, self._tiers[tier].durable)

    def _drop_from_tier(self, meta: BlockMeta, tier: int, *, delete: bool = True) -> None:
        if tier not in meta.tiers:
            return
        if delete:
            self._tiers[tier].delete(meta.block_hash)
        self._index.remove_copy(meta, tier)
        for observer in self._observers:
            observer.block_removed(
                meta.block_hash, self._tiers[tier].name, self._tiers[tier].durable
            )

    def _notify_touched(self, metas: Sequence[BlockMeta]) -> None:
        if metas:
            for observer in self._observers:
                observer.blocks_touched(metas)

    @contextmanager
    def _pinned_for_read(self, block_hash: BlockHash) -> Iterator[BlockMeta]:
        with self._lock:
            now = self._clock.now()
            meta = self._index.held(block_hash, now)
            if meta is None:
                raise BlockNotFound(f"block {block_hash.hex()} is not held")
            self._index.touch(meta, now, None, self._index.next_op())
            self._notify_touched([meta])
            self._index.ref(meta)
        try:
            yield meta
        finally:
            with self._lock:
                self._index.unref(meta)
                if not meta.tiers:
                    self._index.forget(meta)

    # -- validation and start-up --------------------------------------------------------

    def _tier_by_name(self, name: str) -> int:
        try:
            return self._tier_index[name]
        except KeyError:
            raise UnknownTier(
                f"no tier named {name!r}; tiers are {list(self._tier_index)}"
            ) from None

    def _first_durable(self, start: int) -> int | None:
        return next((i for i in range(start, len(self._tiers)) if self._tiers[i].durable), None)

    def _validate_segment(
        self,
        hashes: Sequence[BlockHash],
        payloads: Sequence[Payload],
        namespace_root: bytes,
        parent: BlockHash | None,
    ) -> list[int]:
        if len(hashes) != len(payloads):
            raise InvalidInput(f"{len(hashes)} ids but {len(payloads)} payloads")
        for h in [*hashes, *([parent] if parent is not None else []), namespace_root]:
            if not isinstance(h, bytes) or len(h) != HASH_BYTES:
                raise InvalidInput(f"ids and namespace roots are {HASH_BYTES} bytes, got {h!r:.60}")
        sizes = [payload_nbytes(p) for p in payloads]
        with self._lock:
            expected = self._payload_sizes.get(namespace_root)
            for block_hash, nbytes in zip(hashes, sizes, strict=True):
                if nbytes == 0:
                    raise PayloadSizeError(f"block {block_hash.hex()}: empty payload")
                if expected is None:
                    expected = nbytes
                if nbytes != expected:
                    raise PayloadSizeError(
                        f"block {block_hash.hex()}: payload is {nbytes} bytes, but blocks of "
                        f"this namespace are {expected} bytes"
                    )
            if expected is not None:
                self._payload_sizes.setdefault(namespace_root, expected)
        return sizes

    def _adopt_recovered(self) -> None:
        """Index what durable tiers found on start (their files outlive the process)."""
        now = self._clock.now()
        for index, tier in enumerate(self._tiers):
            if not isinstance(tier, RecoverableTier):
                continue
            adopted = 0
            for found in tier.recovered():
                self._index.adopt_recovered(found, index, now, self._default_ttl)
                self._payload_sizes.setdefault(found.namespace_root, found.nbytes)
                adopted += 1
            if adopted:
                log.info("adopted %d blocks found in tier %s", adopted, tier.name)
        self._index.relink()  # chain links need every record in place first


def _check_ttl(ttl_s: float) -> float:
    if not isinstance(ttl_s, int | float) or ttl_s != ttl_s or ttl_s <= 0:
        raise InvalidInput(f"a TTL must be a positive number of seconds, got {ttl_s!r}")
    return float(ttl_s)
