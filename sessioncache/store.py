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
* The same-host data path (``docs/dataplane.md``, "Same host"), over the store's
  shared-memory tier (``tiers.base.SharedMemoryTier``, the CPU tier in memfd segments):
  ``locate(hashes)`` says where each block of a leased match lies in it, copying into it first
  the blocks held only elsewhere; ``stage`` reserves slots that another process fills in
  place, ``commit`` verifies and publishes them as blocks, ``abort`` frees them.

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

import gc
import logging
import secrets
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import NamedTuple

import numpy as np
import torch
import xxhash

from sessioncache.blocks import BlockMeta
from sessioncache.clock import Clock, SystemClock
from sessioncache.errors import (
    BlockNotFound,
    DurableStoreFailed,
    InvalidInput,
    LeaseNotFound,
    PayloadSizeError,
    TierFull,
    UnknownTier,
)
from sessioncache.events import DropObserver, StoreObserver
from sessioncache.hashing import HASH_BYTES, BlockHash
from sessioncache.index import BlockIndex, Lease, Run
from sessioncache.policy import EvictionPolicy
from sessioncache.status import BlockStatus
from sessioncache.tiers.base import (
    BatchRecoverableTier,
    CheckedTier,
    RecoverableTier,
    RecoveredBatch,
    RecoveredBlock,
    SharedMemoryTier,
    SharedTier,
    SlotLocation,
    StagedSlot,
    Tier,
)
from sessioncache.tiers.payload import Payload, as_memoryview, payload_nbytes

log = logging.getLogger("sessioncache.store")

DEFAULT_TTL_S = 3 * 24 * 3600.0
"""Blocks stored without a TTL live three days past their last access (the agent default)."""

_PLACE_ATTEMPTS = 8
_ADOPT_CHUNK = 65536  # blocks found on start, indexed a batch at a time


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


class WriteResult(NamedTuple):
    """What a store did with each block of a segment (``put``, or a ``commit`` of a staging's
    next blocks): ``status[i]`` is ``hashes[i]``'s."""

    hashes: list[BlockHash]
    status: list[BlockStatus]

    def _having(self, status: BlockStatus) -> list[BlockHash]:
        return [h for h, s in zip(self.hashes, self.status, strict=True) if s is status]

    @property
    def stored(self) -> list[BlockHash]:
        """Newly written by this call."""
        return self._having(BlockStatus.STORED)

    @property
    def present(self) -> list[BlockHash]:
        """Already held (their TTL was extended) or being stored by another caller."""
        return self._having(BlockStatus.PRESENT)

    @property
    def dropped(self) -> list[BlockHash]:
        """Not stored: no tier could make room, or after a block that is not held."""
        return self._having(BlockStatus.DROPPED)

    @property
    def rejected(self) -> list[BlockHash]:
        """A staged slot whose bytes did not match what its writer said: not published."""
        return self._having(BlockStatus.REJECTED)


@dataclass(frozen=True, slots=True)
class LocatedSlot:
    """Where a block of a leased match lies in the shared-memory tier."""

    block_hash: BlockHash
    location: SlotLocation
    checksum: int
    """XXH3-64 (seed 0) of the payload."""


@dataclass(eq=False)
class Write:
    """A prepared write of one chain segment (``TieredStore.prepare``). Its blocks are filled
    one of two ways:

    - ``fill(write, i, payload)``: the caller hands block ``i``'s payload (``put``, a REST
      upload, a block read off the stream);
    - ``reserve(write)`` gives each block not held yet a slot in the shared-memory tier, which
      another process fills in place, and ``publish(write, ...)`` verifies and publishes the
      next of them, in order (a same-host stage and its commits); ``abort`` frees the rest.

    Either way a filled block is written through (to the write-through tiers, and with
    ``durable`` to the first durable tier before the call returns) by the same code, and
    ``status[i]`` says what became of block ``i`` (None until it is filled or reserved; after
    ``reserve``, ``STORED`` means a slot to fill)."""

    id: str
    namespace_root: bytes
    hashes: list[BlockHash]
    parents: list[BlockHash | None]
    nbytes: int | None
    """Each payload's size (None: checked against the namespace's at each fill)."""
    ttl: float
    tier: int
    """The first tier to try."""
    exact_tier: bool
    """Placed in ``tier`` as named, not lowered to its parent's tier."""
    durable_tier: int | None
    op: int
    at: float
    """The operation's instant: its records share it (creation, access and expiry times)."""
    status: list[BlockStatus | None] = field(default_factory=list)
    slots: list[StagedSlot | None] = field(default_factory=list)
    metas: list[BlockMeta | None] = field(default_factory=list)
    open: bool = True
    claimed: int = 0
    """Staged blocks a ``publish`` took so far (done or under way): the next starts here."""
    broken: bool = False
    """A staged block was rejected: every later one is dropped."""

    @property
    def locations(self) -> list[SlotLocation | None]:
        return [slot.location if slot is not None else None for slot in self.slots]


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
    loaded_bytes: int = 0
    """Payload bytes handed to readers: block reads and same-host locates (load GB/s)."""


@dataclass(slots=True)
class NamespaceUsage:
    blocks: int = 0
    bytes: int = 0


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
        # Blocks being copied up (promotion): a second reader waits for the first copy.
        self._promoting: dict[BlockHash, threading.Event] = {}
        self._observers = list(observers)
        self._drop_observers = [o for o in observers if isinstance(o, DropObserver)]
        # The fleet's shared tier (at most one): looked up on local misses, and never
        # trimmed by this node's expiry sweep (its keys expire in the shared server itself).
        shared = [(i, t) for i, t in enumerate(self._tiers) if isinstance(t, SharedTier)]
        if len(shared) > 1:
            raise InvalidInput("a store takes at most one shared tier")
        self._shared: tuple[int, SharedTier] | None = shared[0] if shared else None
        # The tier other processes on this host map (the same-host path); the first one.
        self._shm: tuple[int, SharedMemoryTier] | None = next(
            ((i, t) for i, t in enumerate(self._tiers) if isinstance(t, SharedMemoryTier)), None
        )
        self._write_through_tiers = sorted({self._tier_by_name(name) for name in write_through})
        # The name of the fastest tier in each tier mask (``BlockMeta.mask``).
        self._fastest_name = [
            names[(mask & -mask).bit_length() - 1] if mask else ""
            for mask in range(1 << len(names))
        ]
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

    def observe(self, observer: StoreObserver) -> None:
        """Add an observer (one the node builds after the store: miss attribution)."""
        with self._lock:
            self._observers.append(observer)
            if isinstance(observer, DropObserver):
                self._drop_observers.append(observer)

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
            matched = self._index.held_run(hashes, now)
            short = len(matched) < len(hashes) and self._shared is not None
            if not short:
                return self._finish_lookup(hashes, matched, now, lease_s, ttl_s)
        # Local tiers stop short: the fleet's shared tier may hold the rest of the chain,
        # stored by another node. One round trip, outside the lock.
        self._adopt_shared(hashes, len(matched), now)
        with self._lock:
            now = self._clock.now()
            return self._finish_lookup(
                hashes, self._index.held_run(hashes, now), now, lease_s, ttl_s
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
            matched = self._index.held_run(hashes, now)
            self._index.touch_run(matched, now, ttl_s, hit=False)
            self._notify_touched(matched, hashes)
            return len(matched)

    def _finish_lookup(
        self,
        hashes: Sequence[BlockHash],
        matched: Run,
        now: float,
        lease_s: float | None,
        ttl_s: float | None,
    ) -> Match:
        """Count, touch and lease a lookup's match (lock held)."""
        n = len(matched)
        self._counters.lookups += 1
        self._counters.hit_blocks += n
        self._counters.miss_blocks += len(hashes) - n
        self._index.touch_run(matched, now, ttl_s)
        self._notify_touched(matched, hashes)
        lease = None
        if lease_s is not None and n:
            lease = self._index.lease(self._index.metas(matched, hashes), now + lease_s)
        return Match(
            list(hashes[:n]),  # the matched run is a prefix of the ids asked
            self._index.names(matched, self._fastest_name),
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
        """Unpin a lease's blocks; raises ``LeaseNotFound`` if it is unknown or already over
        (past its expiry, even if not reaped yet: then it is released all the same). A release
        that does not raise therefore means the blocks stayed pinned since the lookup: the
        same-host path relies on it (a reader that copied under an expired lease discards)."""
        with self._lock:
            if not self._index.release(lease_id, self._clock.now()):
                raise LeaseNotFound(f"no live lease {lease_id!r}")

    def lease_hashes(self, lease_id: str) -> tuple[BlockHash, ...] | None:
        """The blocks a lease pins; None when there is no such lease (any more)."""
        with self._lock:
            lease = self._index.find_lease(lease_id)
            return lease.hashes if lease is not None else None

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

    def chain_tiers(self, head: BlockHash) -> list[tuple[BlockMeta, list[str]]]:
        """The held chain ending at ``head`` (root first) as record snapshots with the names
        of the tiers holding each block, fastest first: one pass under the lock."""
        with self._lock:
            out = []
            for block_hash in self._index.chain_to(head):
                meta = self._index.snapshot(block_hash)
                if meta is not None:
                    out.append((meta, [self._tiers[t].name for t in sorted(meta.tiers)]))
            return out

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

    def held_under(self, namespace_root: bytes, hashes: Sequence[BlockHash]) -> list[bool]:
        """For each id, whether a tier holds it unexpired under ``namespace_root`` (one pass
        under the lock; nothing touched): the presence test of keyed blocks."""
        with self._lock:
            now = self._clock.now()
            out = []
            for block_hash in hashes:
                meta = self._index.held(block_hash, now)
                out.append(meta is not None and meta.namespace_root == namespace_root)
            return out

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
            counters = replace(self._counters)
        if self._shared is not None:
            # damaged values the shared tier met while locating: never read, still corrupt
            counters.corrupt_reads += self._shared[1].corrupt_located()
        return counters

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
        with self._lock:
            self._counters.loaded_bytes += meta.nbytes
        if promote and tier > 0:
            with self._lock:
                first = block_hash not in self._promoting
                if first:
                    event = self._promoting[block_hash] = threading.Event()
            if first:
                try:
                    if self._place(meta, data, 0, stop=tier) is not None:
                        with self._lock:
                            self._counters.promotions += 1
                finally:
                    with self._lock:
                        self._promoting.pop(block_hash, None)
                    event.set()
        return data

    # -- the write path: prepare, fill (or reserve and publish), abort ------------------

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
    ) -> WriteResult:
        """Store a chain segment: ``hashes[0]``'s parent is ``parent`` (None at a chain root).
        ``prepare`` and ``fill`` of each block in order; after a block that is not held, the
        rest is dropped (it would hang off it, unreachable).

        Every payload of one namespace must have the same size; a mismatch raises
        ``PayloadSizeError`` before anything is written."""
        if len(hashes) != len(payloads):
            raise InvalidInput(f"{len(hashes)} ids but {len(payloads)} payloads")
        self._check_ids(hashes, namespace_root, parent)
        sizes = [payload_nbytes(p) for p in payloads]
        for block_hash, nbytes in zip(hashes, sizes, strict=True):
            if nbytes != sizes[0]:
                raise PayloadSizeError(
                    f"block {block_hash.hex()}: payload is {nbytes} bytes, but blocks of this "
                    f"namespace are {sizes[0]} bytes"
                )
        write = self.prepare(
            hashes,
            namespace_root=namespace_root,
            nbytes=sizes[0] if sizes else 1,
            parents=[parent, *hashes[:-1]][: len(hashes)],
            ttl_s=ttl_s,
            tier=tier,
            durable=durable,
        )
        for i, payload in enumerate(payloads):
            if i and not _held(write.status[i - 1]):
                self._count(dropped=len(hashes) - i)
                write.status[i:] = [BlockStatus.DROPPED] * (len(hashes) - i)
                break
            self.fill(write, i, payload)
        return WriteResult(write.hashes, [s or BlockStatus.DROPPED for s in write.status])

    def prepare(
        self,
        hashes: Sequence[BlockHash],
        *,
        namespace_root: bytes,
        nbytes: int | None,
        parents: Sequence[BlockHash | None],
        ttl_s: float | None = None,
        tier: str | None = None,
        durable: bool = False,
    ) -> Write:
        """A write of ``hashes`` (``parents[i]`` is block ``i``'s parent: the previous block
        of a chain segment, or None for keyed blocks that stand alone) of ``nbytes`` each
        (None: not known yet, checked per fill), into tier ``tier`` (default: the first, or
        the parent's if lower). Checks what it can for all blocks (ids, the namespace's
        payload size, the TTL, a durable tier to write through to) before any is written."""
        if len(parents) != len(hashes):
            raise InvalidInput(f"{len(hashes)} ids but {len(parents)} parents")
        start = self._tier_by_name(tier) if tier is not None else 0
        ttl = self._default_ttl if ttl_s is None else _check_ttl(ttl_s)
        self._check_ids(hashes, namespace_root, None)
        self._check_ids([p for p in parents if p is not None], namespace_root, None)
        if nbytes is not None:
            self._check_sizes(hashes, [nbytes] * len(hashes), namespace_root)
        durable_tier = self._first_durable(start) if durable else None
        if durable and durable_tier is None:
            raise InvalidInput("durable=True but no durable tier at or below the target tier")
        with self._lock:
            op = self._index.next_op()
            at = self._clock.now()
            self._counters.puts += 1
        n = len(hashes)
        return Write(
            secrets.token_hex(16),
            namespace_root,
            list(hashes),
            list(parents),
            nbytes,
            ttl,
            start,
            tier is not None,
            durable_tier,
            op,
            at,
            status=[None] * n,
        )

    def fill(self, write: Write, index: int, payload: Payload) -> BlockStatus:
        """Store block ``index`` of a prepared write from ``payload``: ``STORED``, ``PRESENT``
        (held already, or another caller is storing it) or ``DROPPED`` (no tier could make
        room). Raises ``DurableStoreFailed`` when a durable write's block could not reach the
        durable tier (it is then held, in memory only)."""
        block_hash = write.hashes[index]
        nbytes = payload_nbytes(payload)
        if write.nbytes is None:
            self._check_sizes([block_hash], [nbytes], write.namespace_root)
        elif nbytes != write.nbytes:
            raise PayloadSizeError(
                f"block {block_hash.hex()}: payload is {nbytes} bytes, but blocks of this "
                f"namespace are {write.nbytes} bytes"
            )
        meta = self._claim(
            block_hash,
            write.parents[index],
            write.namespace_root,
            nbytes,
            write.ttl,
            write.op,
            write.at,
        )
        if meta is None:
            write.status[index] = BlockStatus.PRESENT
            return BlockStatus.PRESENT
        durable = True
        try:
            # By default no faster than its parent: a fast tier holds the heads of chains,
            # which then leave it tail first, as they leave the store.
            with self._lock:
                target = (
                    write.tier
                    if write.exact_tier
                    else max(write.tier, self._index.parent_tier(meta))
                )
            placed = self._place(meta, payload, target)
            if placed is not None:
                durable = self._write_through(write, meta, payload, placed)
        finally:
            self._unclaim(meta)
        status = BlockStatus.STORED if placed is not None else BlockStatus.DROPPED
        write.status[index] = status
        self._count(stored=int(placed is not None), dropped=int(placed is None))
        if not durable:
            self._durable_failed(write, block_hash)
        return status

    def _write_through(self, write: Write, meta: BlockMeta, payload: Payload, placed: int) -> bool:
        """Copy a block just placed in tier ``placed`` to the write-through tiers and, for a
        durable write, to its durable tier; False when that durable copy could not be made."""
        also = [t for t in self._write_through_tiers if t != placed]
        if write.durable_tier is not None and write.durable_tier not in (placed, *also):
            also.append(write.durable_tier)
        for extra in also:
            self._place(meta, payload, extra, stop=extra + 1)
        return write.durable_tier is None or write.durable_tier in meta.tiers

    def _durable_failed(self, write: Write, block_hash: BlockHash) -> None:
        assert write.durable_tier is not None
        name = self._tiers[write.durable_tier].name
        raise DurableStoreFailed(
            f"the durable tier {name!r} could not take block {block_hash.hex()} (its "
            "filesystem is full, or nothing there can be evicted): the block is held in memory "
            "only, not durably; durable stores fail until space returns"
        )

    def _count(self, *, stored: int = 0, dropped: int = 0) -> None:
        with self._lock:
            self._counters.stored_blocks += stored
            self._counters.dropped_blocks += dropped

    def _unclaim(self, meta: BlockMeta) -> None:
        with self._lock:
            self._index.unref(meta)
            if not meta.tiers:
                self._index.forget(meta)

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

    def namespace_usage(self) -> dict[bytes, NamespaceUsage]:
        """Blocks and payload bytes held per namespace root, for the dashboard and scrapes.

        The lock is held only to copy two columns of the held records; the counting runs
        outside, so a scrape does not stall the data path for it: figures of a moment, as
        any scrape's."""
        with self._lock:
            root_list, roots, nbytes = self._index.held_columns()
        numbers, inverse = np.unique(roots, return_inverse=True)
        blocks = np.bincount(inverse, minlength=len(numbers))
        sizes = np.bincount(inverse, weights=nbytes, minlength=len(numbers))
        return {
            root_list[number]: NamespaceUsage(count, int(size))
            for number, count, size in zip(
                numbers.tolist(), blocks.tolist(), sizes.tolist(), strict=True
            )
        }

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

    # -- the same-host data path (shared-memory tier) -----------------------------------

    @property
    def shared_memory_tier(self) -> SharedMemoryTier | None:
        """The tier same-host peers map, if the store has one."""
        return self._shm[1] if self._shm is not None else None

    @property
    def shared_memory_tier_name(self) -> str | None:
        """The name of that tier (a write prepared into it can be ``reserve``d)."""
        return self._tiers[self._shm[0]].name if self._shm is not None else None

    def _require_shm(self) -> tuple[int, SharedMemoryTier]:
        if self._shm is None:
            raise InvalidInput("this store has no shared-memory tier (the same-host path is off)")
        return self._shm

    def locate(self, hashes: Sequence[BlockHash]) -> list[LocatedSlot]:
        """Where each block of ``hashes`` lies in the shared-memory tier, with its checksum,
        as far as the run goes: the caller holds a lease on them (``lookup(..., lease_s=)``),
        which keeps each slot from reuse until it is released or expires.

        A block held only in other tiers is copied into the shared-memory tier first (making
        room there as a put does); the answer stops at the first block that is not pinned,
        that no tier can read, or that cannot be given room there (everything pinned).
        """
        shm_index, tier = self._require_shm()
        located: list[LocatedSlot] = []
        for block_hash in hashes:
            with self._lock:
                meta = self._index.get(block_hash)
                if meta is None or not meta.tiers or not meta.ref_cnt:
                    break
            location = tier.locate(block_hash)
            if location is None:
                if not self._copy_into(meta, shm_index):
                    break
                location = tier.locate(block_hash)
                if location is None:
                    break
            with self._lock:
                if not meta.live:  # the lease lapsed and the record went meanwhile
                    break
                checksum = meta.checksum
                self._counters.loaded_bytes += meta.nbytes  # the engine maps and reads it
            if checksum is None:
                view = self._tiers[shm_index].get(block_hash)
                if view is None:
                    break
                checksum = _xxh3(as_memoryview(view))
                with self._lock:
                    if not meta.live:
                        break
                    meta.checksum = checksum
            located.append(LocatedSlot(block_hash, location, checksum))
        return located

    def _copy_into(self, meta: BlockMeta, target: int) -> bool:
        """Copy a (pinned) block held in other tiers into tier ``target``, once however many
        callers ask at the same time (the others wait for the first); True when it is there."""
        block_hash = meta.block_hash
        while True:
            with self._lock:
                event = self._promoting.get(block_hash)
                if event is None:
                    if target in meta.tiers:
                        return True
                    sources = sorted(t for t in meta.tiers if t != target)
                    if not sources:
                        return False
                    event = self._promoting[block_hash] = threading.Event()
                    break
            event.wait()
        try:
            data = self._tiers[sources[0]].get(block_hash)
            if data is None:
                return False  # that tier lost it (or is down): a later read forgets the copy
            placed = self._place(meta, data, target, stop=target + 1)
            if placed is not None:
                with self._lock:
                    self._counters.promotions += 1
            return placed is not None
        finally:
            with self._lock:
                self._promoting.pop(block_hash, None)
            event.set()

    def stage(
        self,
        hashes: Sequence[BlockHash],
        *,
        namespace_root: bytes,
        nbytes: int,
        parent: BlockHash | None = None,
        ttl_s: float | None = None,
        durable: bool = False,
        parents: Sequence[BlockHash | None] | None = None,
    ) -> Write:
        """``prepare`` a write into the shared-memory tier and ``reserve`` its slots: a slot
        of ``nbytes`` for each block not held yet (making room by eviction, as ``put`` does),
        for another process to fill in place; ``commit`` publishes them, ``abort`` frees
        them. A staged block is invisible to lookups until committed; its record is pinned
        meanwhile, so a ``put`` of the same id answers present. Staged slots never expire:
        their owner (a connection) aborts them when it ends, since a writer may still be
        filling them.

        ``parents`` gives each block's parent instead (keyed blocks that are no chain)."""
        shm_index, _ = self._require_shm()
        if parents is None:
            parents = [parent, *hashes[:-1]][: len(hashes)]
        write = self.prepare(
            hashes,
            namespace_root=namespace_root,
            nbytes=nbytes,
            parents=parents,
            ttl_s=ttl_s,
            tier=self._tiers[shm_index].name,
            durable=durable,
        )
        try:
            self.reserve(write)
        except BaseException:
            self.abort(write)
            raise
        return write

    def reserve(self, write: Write) -> None:
        """Claim each block of a write prepared for the shared-memory tier and reserve its
        slot there: ``STORED`` (``slots[i]`` to fill), ``PRESENT`` (held, or being stored by
        another caller: nothing to write) or ``DROPPED`` (no room; so is every block after)."""
        shm_index, _ = self._require_shm()
        if write.nbytes is None or write.tier != shm_index:
            raise InvalidInput("reserve: a write prepared for the shared-memory tier, sized")
        dropped = False
        for i, block_hash in enumerate(write.hashes):
            meta = None
            if not dropped:
                meta = self._claim(
                    block_hash,
                    write.parents[i],
                    write.namespace_root,
                    write.nbytes,
                    write.ttl,
                    write.op,
                    write.at,
                )
                if meta is None:
                    self._staged(write, BlockStatus.PRESENT, None, None)
                    continue
            slot = self._reserve(meta, shm_index) if meta is not None else None
            if slot is None:
                if meta is not None:
                    self._unclaim(meta)
                dropped = True
                self._staged(write, BlockStatus.DROPPED, None, None)
            else:
                self._staged(write, BlockStatus.STORED, slot, meta)

    @staticmethod
    def _staged(
        write: Write, status: BlockStatus, slot: StagedSlot | None, meta: BlockMeta | None
    ) -> None:
        write.status[len(write.slots)] = status
        write.slots.append(slot)
        write.metas.append(meta)

    def _reserve(self, meta: BlockMeta, index: int) -> StagedSlot | None:
        assert self._shm is not None
        tier = self._shm[1]
        for _ in range(_PLACE_ATTEMPTS):
            if self._tiers[index].fits(meta.nbytes):
                try:
                    return tier.reserve(meta.nbytes)
                except TierFull:
                    continue  # another thread took the room: evict again
            if not self._evict_one(index, meta):
                break
        return None

    def commit(
        self,
        write: Write,
        checksums: Sequence[int],
        lengths: Sequence[int] | None = None,
    ) -> WriteResult:
        """Publish the next ``len(checksums)`` blocks of a staged write (all of them in one
        call, or in order over several: a writer may commit the blocks it has filled while it
        fills the next) whose slots hold what the writer says it wrote: per block, the length
        (when given) and the XXH3-64 (seed 0) of the slot's bytes. A block that does not match
        is rejected, and every later block of the staging is dropped (they would hang off it).
        Published blocks are written through as a ``fill`` does; when a durable write's block
        cannot reach its durable tier, the rest of the write is aborted and
        ``DurableStoreFailed`` raised. Entries of present or dropped blocks are ignored."""
        shm_index, tier = self._require_shm()
        n = len(checksums)
        if lengths is not None and len(lengths) != n:
            raise InvalidInput(f"{n} checksums but {len(lengths)} lengths")
        with self._lock:
            if not write.open:
                raise InvalidInput(f"staging {write.id} is already committed or aborted")
            start = write.claimed
            if not 0 < n <= len(write.hashes) - start:
                raise InvalidInput(
                    f"staging {write.id}: {n} blocks to commit, {len(write.hashes) - start} left"
                )
            write.claimed = start + n
        status: list[BlockStatus] = []
        unsaved: BlockHash | None = None
        for k, i in enumerate(range(start, start + n)):
            block_hash = write.hashes[i]
            slot, meta = write.slots[i], write.metas[i]
            if write.status[i] is BlockStatus.PRESENT:
                status.append(BlockStatus.PRESENT)
                continue
            if slot is None or meta is None or unsaved is not None:
                if slot is not None:
                    tier.release_reserved(slot)
                if meta is not None:
                    self._unclaim(meta)
                status.append(BlockStatus.DROPPED)
                continue
            try:
                if write.broken:
                    tier.release_reserved(slot)
                    status.append(BlockStatus.DROPPED)
                    continue
                good = (lengths is None or lengths[k] == slot.location.nbytes) and (
                    _xxh3(as_memoryview(slot.payload)) == checksums[k]
                )
                if not good:
                    tier.release_reserved(slot)
                    status.append(BlockStatus.REJECTED)
                    write.broken = True
                    continue
                if not tier.publish(block_hash, slot):
                    status.append(BlockStatus.PRESENT)
                    continue
                with self._lock:
                    meta.checksum = checksums[k]
                    self._add_to_tier(meta, shm_index)
                if not self._write_through(write, meta, slot.payload, shm_index):
                    unsaved = block_hash
                status.append(BlockStatus.STORED)
            finally:
                self._unclaim(meta)
        write.status[start : start + n] = status
        result = WriteResult(write.hashes[start : start + n], status)
        with self._lock:
            if write.claimed == len(write.hashes):
                write.open = False
        self._count(stored=len(result.stored), dropped=len(result.dropped) + len(result.rejected))
        if unsaved is not None:
            self.abort(write)
            self._durable_failed(write, unsaved)
        return result

    def abort(self, write: Write) -> int:
        """Free the slots of a staged write's blocks not committed yet and forget their
        records (nothing of them was visible); returns how many slots were freed (0 once the
        staging is wholly committed or aborted)."""
        with self._lock:
            if not write.open:
                return 0
            write.open = False
            start = write.claimed
            write.claimed = len(write.hashes)
        tier = self._require_shm()[1]
        freed = 0
        for slot, meta in zip(write.slots[start:], write.metas[start:], strict=True):
            if slot is not None:
                tier.release_reserved(slot)
                freed += 1
            if meta is not None:
                self._unclaim(meta)
        return freed

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
                        if not meta.live:  # its record went meanwhile (a lapsed lease)
                            self._tiers[tier].delete(meta.block_hash)
                            return None
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
        now: float,
    ) -> BlockMeta | None:
        """Create the record of a block about to be stored (at ``now``, the operation's
        instant), pinned while in flight; None when it is already held (its TTL is extended)
        or another caller is storing it."""
        with self._lock:
            meta = self._index.get(block_hash)
            if meta is not None:
                if meta.mask:
                    # now, not the operation's instant: a touch never moves a block back
                    self._index.touch(meta, self._clock.now(), ttl, op)
                    self._notify_touched(Run.one(meta.slot), [meta.block_hash])
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
        if not meta.tiers and self._drop_observers:  # its last copy: a miss from now on
            now = self._clock.now()
            for drop_observer in self._drop_observers:
                drop_observer.block_dropped(meta, self._tiers[tier].name, now)

    def _notify_touched(self, run: Run, hashes: Sequence[BlockHash]) -> None:
        """Tell observers of a touch of ``run``, the slots of ``hashes[:len(run)]``."""
        if len(run) and self._observers:
            touched = self._index.touched(run, hashes)
            for observer in self._observers:
                observer.blocks_touched(touched)

    @contextmanager
    def _pinned_for_read(self, block_hash: BlockHash) -> Iterator[BlockMeta]:
        with self._lock:
            now = self._clock.now()
            meta = self._index.held(block_hash, now)
            if meta is None:
                raise BlockNotFound(f"block {block_hash.hex()} is not held")
            self._index.touch(meta, now, None, self._index.next_op())
            self._notify_touched(Run.one(meta.slot), [block_hash])
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

    @staticmethod
    def _check_ids(
        hashes: Sequence[BlockHash], namespace_root: bytes, parent: BlockHash | None
    ) -> None:
        for h in [*hashes, *([parent] if parent is not None else []), namespace_root]:
            if not isinstance(h, bytes) or len(h) != HASH_BYTES:
                raise InvalidInput(f"ids and namespace roots are {HASH_BYTES} bytes, got {h!r:.60}")

    def _check_sizes(
        self, hashes: Sequence[BlockHash], sizes: Sequence[int], namespace_root: bytes
    ) -> None:
        """Every payload of one namespace has the same size (remembered from the first)."""
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

    def adopt_found(self, tier_name: str, found: Sequence[RecoveredBlock]) -> int:
        """Index blocks a durable tier found while the store serves (the background pass of
        a fast restart: files the catalog lacked), as copies added now: observers hear of
        them (the catalog writes their rows). Returns how many were new to the store."""
        index = self._tier_by_name(tier_name)
        adopted = 0
        with self._lock:
            now = self._clock.now()
            for block in found:
                meta = self._index.get(block.block_hash)
                if meta is None:
                    meta = self._index.new_record(
                        block.block_hash,
                        parent=block.parent,
                        namespace_root=block.namespace_root,
                        nbytes=block.nbytes,
                        ttl_s=block.ttl_s if block.ttl_s is not None else self._default_ttl,
                        created=block.mtime,
                        last_access=min(block.mtime, now),
                        expires_at=block.expires_at,
                    )
                elif meta.mask >> index & 1:
                    continue
                self._payload_sizes.setdefault(block.namespace_root, block.nbytes)
                self._add_to_tier(meta, index)
                adopted += 1
        return adopted

    def forget_copies(self, tier_name: str, hashes: Sequence[BlockHash]) -> int:
        """Forget the copies in ``tier_name`` of blocks that tier no longer holds (their files
        are gone), unless pinned (a read under way finds out itself); observers hear of it.
        Returns how many were forgotten."""
        index = self._tier_by_name(tier_name)
        forgotten = 0
        with self._lock:
            for block_hash in hashes:
                meta = self._index.get(block_hash)
                if meta is None or meta.ref_cnt or not meta.mask >> index & 1:
                    continue
                self._drop_from_tier(meta, index, delete=False)
                forgotten += 1
        return forgotten

    def _adopt_recovered(self) -> None:
        """Index what durable tiers found on start (their files outlive the process).

        The cyclic garbage collector is held off meanwhile: a bulk load of long-lived
        records would otherwise trigger full collections over a growing heap (quadratic)."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._adopt_all()
        finally:
            if collecting:
                gc.enable()

    def _adopt_all(self) -> None:
        now = self._clock.now()
        for index, tier in enumerate(self._tiers):
            if not isinstance(tier, RecoverableTier):
                continue
            adopted = 0
            for batch in _batches(tier):
                self._index.adopt_recovered(batch, index, now, self._default_ttl)
                sizes = self._payload_sizes
                for root, nbytes in zip(batch.namespace_roots, batch.nbytes.tolist(), strict=True):
                    if root not in sizes:
                        sizes[root] = nbytes
                adopted += len(batch)
            if adopted:
                log.info("adopted %d blocks found in tier %s", adopted, tier.name)
        self._index.relink()  # chain links need every record in place first


def _batches(tier: RecoverableTier) -> Iterator[RecoveredBatch]:
    """What ``tier`` found on start, in batches: its own when it has them (a fast restart's
    catalog rows), else its blocks gathered."""
    if isinstance(tier, BatchRecoverableTier):
        yield from tier.recovered_batches()
        return
    found = iter(tier.recovered())
    while chunk := list(islice(found, _ADOPT_CHUNK)):
        yield RecoveredBatch.of(chunk)


def _xxh3(data: memoryview) -> int:
    """XXH3-64 (seed 0) of a payload, computed with the GIL released (``xxh3_64_intdigest``
    holds it for the whole payload)."""
    return int(xxhash.xxh3_64(data).intdigest())


def _check_ttl(ttl_s: float) -> float:
    if not isinstance(ttl_s, int | float) or ttl_s != ttl_s or ttl_s <= 0:
        raise InvalidInput(f"a TTL must be a positive number of seconds, got {ttl_s!r}")
    return float(ttl_s)


def _held(status: BlockStatus | None) -> bool:
    return status is not None and status.held
