"""The store's core: its tiers, its index and the moves between them (placement, eviction,
promotion), and the index changes that observers hear of. Eviction's rules (victim order,
the tail rule, what may not leave, admission, demotion) are ``store.eviction``'s; the loop
that applies them, with the write-behind's back-pressure, is ``make_room`` here.
``StoreReads``, ``StoreWrites`` and ``StoreRecovery`` work through it; ``TieredStore`` holds
all four."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypedDict

import numpy as np
import torch

from sessioncache.clock import Clock, SystemClock
from sessioncache.errors import (
    BlockNotFound,
    InvalidInput,
    PayloadSizeError,
    TierFull,
    UnknownTier,
)
from sessioncache.hashing import HASH_BYTES, BlockHash
from sessioncache.store.blocks import BlockMeta
from sessioncache.store.events import DropObserver, StoreObserver
from sessioncache.store.eviction import EvictionPolicy
from sessioncache.store.fair import TenantLine
from sessioncache.store.index import BlockIndex, Run
from sessioncache.store.results import (
    _PLACE_ATTEMPTS,
    DEFAULT_TTL_S,
    Counters,
    Write,
    check_ttl,
)
from sessioncache.tiers.base import (
    CheckedTier,
    PutItem,
    RoomBoundTier,
    SharedMemoryTier,
    SharedTier,
    Tier,
)
from sessioncache.tiers.payload import Payload

if TYPE_CHECKING:
    from sessioncache.store.behind import WriteBehind

log = logging.getLogger("sessioncache.store")

DEFAULT_ROOM_WAIT_S = 30.0


class _Evicted(enum.Enum):
    DONE = enum.auto()
    """A victim left the tier."""
    NONE = enum.auto()
    """No victim: every block there is pinned, or the parent of one."""
    REFUSED = enum.auto()
    """The policy keeps the victim over the incoming block."""
    BEHIND = enum.auto()
    """The victim waits for the write-behind, whose copy would make room (kept in place)."""
    STUCK = enum.auto()
    """The victims tried could not be demoted (the tier below had no room it could make, or
    failed): kept in place, since each is the only copy of a block a store was answered for."""


Admits = Callable[[BlockMeta, BlockMeta, int, float], bool]
"""Whether ``incoming`` may enter a tier at the cost of ``victim`` (``EvictionPolicy.admits``'s
signature: victim, incoming, tier, now), called with the store's lock held."""

_STUCK_TRIES = 8
"""Victims an eviction tries past those that cannot be demoted, before it gives up."""


class StoreOptions(TypedDict, total=False):
    """A store's settings beside its tiers and policy (defaults in ``StoreCore``)."""

    clock: Clock | None
    default_ttl_s: float
    promote_on_get: bool
    """Copy a block read from a lower tier up to the first."""
    max_lease_s: float
    observers: Sequence[StoreObserver]
    write_through: Sequence[str]
    """Names of the tiers every write also goes to (the shared tier, under write-through)."""
    write_behind_bytes: int
    """The write-behind queue's bound (``store.behind``); 0: no write-behind (a block reaches
    the durable tier by eviction, or by a durable write's own copy)."""
    write_behind_owner: Callable[[bytes], str]
    """The tenant of a namespace root, whose share of that bound its blocks take (default:
    every block is one tenant's, ``""``)."""
    write_behind_share: Callable[[str], float]
    """The share of that bound a tenant's blocks may take, in (0, 1] (``TenantLimits``;
    default: ``behind.DEFAULT_TENANT_SHARE`` each)."""
    room_wait_s: float
    """How long a store waits for room in a tier whose only evictable blocks are being
    written behind (``StoreCore.make_room``)."""


class StoreCore:
    """State shared by the store's parts, and what they all need of it (one re-entrant lock
    guards the index, the policy and the counters; payload copies run outside it)."""

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
        write_behind_bytes: int = 0,
        write_behind_owner: Callable[[bytes], str] | None = None,
        write_behind_share: Callable[[str], float] | None = None,
        room_wait_s: float = DEFAULT_ROOM_WAIT_S,
    ) -> None:
        if not tiers:
            raise InvalidInput("a store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise InvalidInput(f"tier names must be unique, got {names}")
        check_ttl(default_ttl_s)
        self.tiers = list(tiers)
        self.tier_index = {name: i for i, name in enumerate(names)}
        self.policy = policy or EvictionPolicy(len(self.tiers))
        self.policy.capacities = [t.capacity_bytes for t in self.tiers]
        self.clock: Clock = clock or SystemClock()
        self.default_ttl = default_ttl_s
        self.promote = promote_on_get
        self.max_lease_s = max_lease_s
        self.lock = threading.RLock()
        self.payload_sizes: dict[bytes, int] = {}
        # Blocks being copied up (promotion): a second reader waits for the first copy.
        self.promoting: dict[BlockHash, threading.Event] = {}
        self.observers = list(observers)
        self.drop_observers: list[DropObserver] = [
            o for o in observers if isinstance(o, DropObserver)
        ]
        # The fleet's shared tier (at most one): looked up on local misses, and never
        # trimmed by this node's expiry sweep (its keys expire in the shared server itself).
        shared = [(i, t) for i, t in enumerate(self.tiers) if isinstance(t, SharedTier)]
        if len(shared) > 1:
            raise InvalidInput("a store takes at most one shared tier")
        self.shared: tuple[int, SharedTier] | None = shared[0] if shared else None
        # The tier other processes on this host map (the same-host path); the first one.
        self.shm: tuple[int, SharedMemoryTier] | None = next(
            ((i, t) for i, t in enumerate(self.tiers) if isinstance(t, SharedMemoryTier)), None
        )
        # A lease holds the copies there (the slots it hands out), elsewhere only the block.
        self.index = BlockIndex(
            len(self.tiers), self.policy, slots_tier=-1 if self.shm is None else self.shm[0]
        )
        self.write_through_tiers = sorted({self.tier_by_name(name) for name in write_through})
        self._rooms: list[Callable[[], int] | None] = [
            t.room_bytes if isinstance(t, RoomBoundTier) else None for t in self.tiers
        ]
        # The name of the fastest tier in each tier mask (``BlockMeta.mask``).
        self.fastest_name = [
            names[(mask & -mask).bit_length() - 1] if mask else ""
            for mask in range(1 << len(names))
        ]
        self.counters = Counters()
        if write_behind_bytes < 0:
            raise InvalidInput("write_behind_bytes >= 0")
        self.write_behind_bytes = write_behind_bytes
        self.write_behind_owner = write_behind_owner
        self.write_behind_share = write_behind_share
        self.behind: WriteBehind | None = None
        """The write-behind queue to the first durable tier below the first (``TieredStore``
        makes it)."""
        self.shared_missed: Callable[[BlockMeta], None] | None = None
        """Told of each block whose write-through copy to the shared tier failed
        (``store.republish``, which ``TieredStore`` makes)."""
        if room_wait_s < 0:
            raise InvalidInput("room_wait_s >= 0")
        self.room_wait_s = room_wait_s
        # Blocks the write-behind is copying to the durable tier, per tier holding them
        # (pinned until the copy ends: room that comes back then).
        self.flushing = [0] * len(self.tiers)
        self._room = threading.Condition(threading.Lock())
        self._flushes = 0  # copies ended so far (batches of the write-behind)
        self._lines: dict[int, TenantLine] = {}

    def place(
        self,
        meta: BlockMeta,
        payload: Payload,
        start: int,
        *,
        stop: int | None = None,
        wait: bool = True,
        admits: Admits | None = None,
    ) -> int | None:
        """Write ``payload`` into the first tier at or after ``start`` (before ``stop``) that
        can make room, evicting there as needed (``make_room``: ``wait`` for blocks being
        written behind); returns that tier's index or None. ``admits``: who may be evicted
        for it, instead of the policy's ``admits`` (a prefetch's rule; no waiting then).
        Call without the store's lock."""
        end = len(self.tiers) if stop is None else stop
        for tier in range(start, end):
            if tier in meta.tiers:
                return tier
            if meta.nbytes > self.tiers[tier].capacity_bytes:
                continue
            for _ in range(_PLACE_ATTEMPTS):
                if self.tiers[tier].fits(meta.nbytes):
                    try:
                        self.tiers[tier].put(
                            PutItem(
                                meta.block_hash,
                                payload,
                                meta.namespace_root,
                                meta.parent,
                                meta.expires_at,
                            )
                        )
                    except TierFull:
                        continue  # another thread took the room: evict again
                    with self.lock:
                        if not meta.live:  # its record went meanwhile (a lapsed lease)
                            self.tiers[tier].delete(meta.block_hash)
                            return None
                        self.add_to_tier(meta, tier)
                    return tier
                if meta.nbytes > self.room_of(tier):
                    break  # evicting all it holds would not make room
                if admits is not None:
                    if self._evict(tier, meta, admits=admits) is not _Evicted.DONE:
                        break
                elif not self.make_room(tier, meta, wait=wait):
                    break
        return None

    def evict_one(self, tier: int, incoming: BlockMeta) -> bool:
        """Move one victim out of ``tier`` to admit ``incoming``: demote it, or drop it if
        expired, at the bottom or a spare copy. Refuses (False) when nothing is evictable or
        when the policy does not admit ``incoming`` at the cost of the victim (see
        ``EvictionPolicy.admits``): then ``incoming`` belongs lower down, or nowhere."""
        return self._evict(tier, incoming) is _Evicted.DONE

    def make_room(self, tier: int, incoming: BlockMeta, *, wait: bool = True) -> bool:
        """``evict_one``; with ``wait``, back-pressure rather than a drop or a copy of its own
        when the tier's victims are waiting for the write-behind: when nothing in ``tier`` is
        evictable but blocks being copied to disk (pinned until their copy ends, chain tails
        among them), or the victim would be demoted to the durable tier while still queued
        for it, wait (up to ``room_wait_s``) for the write-behind's next copies, then evict
        (at the deadline, a victim still queued is demoted). Waiters take turns tenant by
        tenant (``fair.TenantLine``); a store arriving while others wait queues behind them. Call
        without the store's lock."""
        if not wait:
            return self.evict_one(tier, incoming)
        with self._room:
            flushes = self._flushes
            queued = tier in self._lines
        if not queued:
            outcome = self._evict(tier, incoming, demote=False)
            if outcome is _Evicted.DONE or outcome is _Evicted.REFUSED:
                return outcome is _Evicted.DONE
            if not self._room_coming(tier, flushes, outcome):
                return outcome is _Evicted.BEHIND and self.evict_one(tier, incoming)
        return self._wait_for_room(tier, incoming, None if queued else flushes)

    def _room_coming(self, tier: int, flushes: int, outcome: _Evicted) -> bool:
        """Whether waiting may make room after ``outcome``: the write-behind is copying
        blocks of ``tier``, or the victim is ``BEHIND`` and blocks are queued (the write-behind
        is hurried on), or a copy ended since ``flushes``."""
        behind = self.behind
        if behind is None or tier >= behind.durable:
            return False
        with self.lock:
            busy = self.flushing[tier] > 0
        if outcome is _Evicted.BEHIND and behind.backlog_bytes:
            behind.hurry()
            busy = True
        with self._room:
            return busy or self._flushes != flushes

    def _wait_for_room(self, tier: int, incoming: BlockMeta, tried: int | None) -> bool:
        """Queue in ``tier``'s line; at the head, evict once the next copy ends (at once if
        ``tried`` is None: not tried yet), until room is made or none can come."""
        deadline = time.monotonic() + self.room_wait_s
        tenant = self.behind.owner(incoming.namespace_root) if self.behind is not None else ""
        waiter = object()
        with self._room:
            line = self._lines.setdefault(tier, TenantLine())
            line.join(tenant, waiter)
            if line.head() is not waiter:
                tried = None  # the head before it may leave room behind: try at its turn
        served = False
        try:
            while True:
                with self._room:
                    while not (turn := line.head() is waiter and self._flushes != tried):
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._room.wait(left)
                    tried = self._flushes
                if not turn:  # past the deadline: a victim still queued is copied now
                    return self.evict_one(tier, incoming)
                outcome = self._evict(tier, incoming, demote=False)
                if outcome is _Evicted.DONE or outcome is _Evicted.REFUSED:
                    served = outcome is _Evicted.DONE
                    return served
                if not self._room_coming(tier, tried, outcome):
                    served = outcome is _Evicted.BEHIND and self.evict_one(tier, incoming)
                    return served
        finally:
            with self._room:
                line.leave(tenant, waiter, served)
                if not line:
                    del self._lines[tier]
                self._room.notify_all()

    def waiting_for_room(self, tier: int) -> int:
        """How many stores wait for room in ``tier`` (``make_room``)."""
        with self._room:
            line = self._lines.get(tier)
            return len(line) if line is not None else 0

    def flush_begin(self, meta: BlockMeta, durable: int) -> tuple[int, ...]:
        """(lock held) Pin ``meta`` while the write-behind copies it to tier ``durable``;
        returns the tiers above it that hold it, for ``flush_end``."""
        self.index.ref(meta, in_flight=True)  # no pin: no tenant's share pays for it
        above = tuple(t for t in meta.tiers if t < durable)
        for t in above:
            self.flushing[t] += 1
        return above

    def flush_end(self, copies: Sequence[tuple[BlockMeta, tuple[int, ...]]]) -> None:
        """Unpin the blocks of ended copies (``flush_begin``) and wake the stores waiting for
        room (``make_room``)."""
        with self.lock:
            for meta, above in copies:
                for t in above:
                    self.flushing[t] -= 1
                self.index.unref(meta, in_flight=True)
                if not meta.tiers:
                    self.index.forget(meta)
        with self._room:
            self._flushes += 1
            self._room.notify_all()

    def _evict(
        self, tier: int, incoming: BlockMeta, *, demote: bool = True, admits: Admits | None = None
    ) -> _Evicted:
        """``evict_one``; ``demote=False``: a victim that would be copied to the durable tier
        while it is queued for the write-behind stays (``BEHIND``). A victim in memory whose
        demotion to the durable tier fails stays too, held until the end of this call so that
        the next one is tried, up to ``_STUCK_TRIES`` (``STUCK``): a block is never dropped for
        want of room on disk (a victim of a durable tier is dropped when the tier below, the
        shared one, cannot take it: it was held, and leaves by policy)."""
        stuck: list[BlockMeta] = []
        try:
            while True:
                outcome = self._evict_once(tier, incoming, demote, stuck, admits)
                if outcome is not _Evicted.STUCK or len(stuck) >= _STUCK_TRIES:
                    return outcome
        finally:
            if stuck:
                with self.lock:
                    for victim in stuck:
                        self.index.unref(victim, in_flight=True)  # a candidate again
                        if not victim.tiers:
                            self.index.forget(victim)

    def _evict_once(
        self,
        tier: int,
        incoming: BlockMeta,
        demote: bool,
        stuck: list[BlockMeta],
        admits: Admits | None = None,
    ) -> _Evicted:
        """One victim of ``_evict``; one that cannot be demoted is added to ``stuck``, still
        held in flight."""
        behind = self.behind
        queued = not demote and behind is not None and tier + 1 == behind.durable
        with self.lock:
            now = self.clock.now()
            victim = self.policy.next_victim(tier, now, self.index.get)
            if victim is None:
                return _Evicted.NONE
            if not (admits or self.policy.admits)(victim, incoming, tier, now):
                self.policy.track(victim, tier)  # not evicted: back in line
                return _Evicted.REFUSED
            demote = self.policy.demotes(victim, tier, now)
            on_the_way = behind is not None and behind.queued(victim.block_hash)
            if queued and demote and on_the_way:
                self.policy.track(victim, tier)  # its copy is on the way: back in line
                return _Evicted.BEHIND
            if not demote:
                # Expired, last tier, or held in another tier too: nothing to copy.
                self.counters.evictions += 1
                if victim.expired(now):
                    self.counters.expirations += 1
                self.policy.left(victim, tier, now)
                self.drop_from_tier(victim, tier)
                return _Evicted.DONE
            # in flight: no other thread may pick or drop it (no tenant's pin share pays)
            self.index.ref(victim, in_flight=True)
        # A copy in memory goes no lower than the durable tier below it (never to the shared
        # tier past a full disk), and stays when it cannot get there: a block that reached the
        # durable tier has been held, and leaves it by policy as from a full budget.
        durable = None if self.tiers[tier].durable else self.first_durable(tier + 1)
        kept = False
        try:
            data = self.tiers[tier].get(victim.block_hash)
            if data is not None:
                stop = None if durable is None else durable + 1
                placed = self.place(victim, data, tier + 1, stop=stop) is not None
                kept = not placed and durable is not None
                if placed:
                    with self.lock:
                        self.counters.demotions += 1
        finally:
            with self.lock:
                if kept:
                    self.counters.demotions_refused += 1
                    stuck.append(victim)
                else:
                    self.counters.evictions += 1
                    self.policy.left(victim, tier, now)
                    # Keep the copy of a block someone pinned meanwhile (a lease taken while
                    # it was in flight may be reading it), even when it found room below.
                    if victim.ref_cnt == 1:
                        self.drop_from_tier(victim, tier)
                    self.index.unref(victim, in_flight=True)
                    if not victim.tiers:
                        self.index.forget(victim)
        return _Evicted.STUCK if kept else _Evicted.DONE

    def claim(
        self, write: Write, start: int, room: int, nbytes: int, stop: int | None = None
    ) -> list[BlockMeta | None]:
        """Create the records of ``write``'s blocks ``start..stop`` (None: to its end), about
        to be stored (``nbytes`` each, at the write's instant), pinned while in flight, in
        order under one lock, up to the block that would make a record past ``room`` (not
        claimed): each
        block's record, or None (held, its TTL extended, or being stored by another caller).
        Observers hear of the touches at once."""
        hashes, parents, ttl, op = write.hashes, write.parents, write.ttl, write.op
        index = self.index
        claimed: list[BlockMeta | None] = []
        touched: list[int] = []  # slots
        touched_ids: list[BlockHash] = []
        made = 0
        with self.lock:
            try:
                touch_at = self.clock.now()
                for j in range(start, len(hashes) if stop is None else stop):
                    block_hash = hashes[j]
                    meta = index.get(block_hash)
                    if meta is not None:
                        if meta.mask:
                            index.touch(meta, touch_at, ttl, op)
                            touched.append(meta.slot)
                            touched_ids.append(block_hash)
                        claimed.append(None)
                        continue
                    if made == room:
                        break
                    made += 1
                    claimed.append(
                        index.new_record(
                            block_hash,
                            parent=parents[j],
                            namespace_root=write.namespace_root,
                            nbytes=nbytes,
                            ttl_s=ttl,
                            created=write.at,
                            ref_cnt=1,
                            touched_by_op=op,
                            next_use=write.next_use,
                        )
                    )
            except BaseException:
                self.unclaim_many([m for m in claimed if m is not None])
                raise
            if touched:
                self.notify_touched(Run(np.array(touched, np.int64)), touched_ids)
        return claimed

    def live(self, block_hash: BlockHash) -> bool:
        """Whether the store holds the block or a caller is storing it now."""
        with self.lock:
            meta = self.index.get(block_hash)
            return meta is not None and (meta.mask != 0 or meta.ref_cnt > 0)

    def unclaim(self, meta: BlockMeta) -> None:
        with self.lock:
            self.index.unref(meta)
            if not meta.tiers:
                self.index.forget(meta)

    def unclaim_many(self, metas: Iterable[BlockMeta]) -> None:
        """``unclaim`` of each of ``metas``, under one lock."""
        index = self.index
        with self.lock:
            for meta in metas:
                index.unref(meta)
                if not meta.tiers:
                    index.forget(meta)

    def add_to_tier(self, meta: BlockMeta, tier: int) -> None:
        if self.index.add_copy(meta, tier):
            for observer in self.observers:
                observer.block_added(meta, self.tiers[tier].name, self.tiers[tier].durable)

    def drop_from_tier(self, meta: BlockMeta, tier: int, *, delete: bool = True) -> None:
        if tier not in meta.tiers:
            return
        if delete:
            self.tiers[tier].delete(meta.block_hash)
        self.index.remove_copy(meta, tier)
        for observer in self.observers:
            observer.block_removed(meta.block_hash, self.tiers[tier].name, self.tiers[tier].durable)
        if not meta.tiers and self.drop_observers:  # its last copy: a miss from now on
            now = self.clock.now()
            for drop_observer in self.drop_observers:
                drop_observer.block_dropped(meta, self.tiers[tier].name, now)

    def notify_touched(self, run: Run, hashes: Sequence[BlockHash]) -> None:
        """Tell observers of a touch of ``run``, the slots of ``hashes[:len(run)]``."""
        if len(run) and self.observers:
            touched = self.index.touched(run, hashes)
            for observer in self.observers:
                observer.blocks_touched(touched)

    @contextmanager
    def pinned_for_read(self, block_hash: BlockHash) -> Iterator[BlockMeta]:
        with self.lock:
            now = self.clock.now()
            meta = self.index.held(block_hash, now)
            if meta is None:
                raise BlockNotFound(f"block {block_hash.hex()} is not held")
            self.index.touch(meta, now, None, self.index.next_op())
            self.notify_touched(Run.one(meta.slot), [block_hash])
            self.index.ref(meta)
        try:
            yield meta
        finally:
            with self.lock:
                self.index.unref(meta)
                if not meta.tiers:
                    self.index.forget(meta)

    def tier_by_name(self, name: str) -> int:
        try:
            return self.tier_index[name]
        except KeyError:
            raise UnknownTier(
                f"no tier named {name!r}; tiers are {list(self.tier_index)}"
            ) from None

    def room_of(self, tier: int) -> int:
        """The most ``tier`` could hold now, all it holds evicted: its capacity, or less where
        what it stands on has less room (``RoomBoundTier``)."""
        room = self._rooms[tier]
        return room() if room is not None else self.tiers[tier].capacity_bytes

    def first_durable(self, start: int) -> int | None:
        return next((i for i in range(start, len(self.tiers)) if self.tiers[i].durable), None)

    @staticmethod
    def check_ids(
        hashes: Sequence[BlockHash], namespace_root: bytes, parent: BlockHash | None
    ) -> None:
        for h in [*hashes, *([parent] if parent is not None else []), namespace_root]:
            if not isinstance(h, bytes) or len(h) != HASH_BYTES:
                raise InvalidInput(f"ids and namespace roots are {HASH_BYTES} bytes, got {h!r:.60}")

    def check_sizes(
        self, hashes: Sequence[BlockHash], sizes: Sequence[int], namespace_root: bytes
    ) -> None:
        """Every payload of one namespace has the same size (remembered from the first)."""
        with self.lock:
            expected = self.payload_sizes.get(namespace_root)
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
                self.payload_sizes.setdefault(namespace_root, expected)

    def require_shm(self) -> tuple[int, SharedMemoryTier]:
        if self.shm is None:
            raise InvalidInput("this store has no shared-memory tier (the same-host path is off)")
        return self.shm

    def read(self, meta: BlockMeta, promote: bool | None) -> torch.Tensor:
        block_hash = meta.block_hash
        promote = self.promote if promote is None else promote
        while True:
            with self.lock:
                if not meta.tiers:
                    raise BlockNotFound(f"block {block_hash.hex()} is not held")
                tier = min(meta.tiers)
            source = self.tiers[tier]
            data = source.get(block_hash)
            if data is not None:
                break
            if isinstance(source, CheckedTier) and source.problem() is not None:
                # Unreachable, not lost (a Redis outage): keep the record, read nothing.
                raise BlockNotFound(f"block {block_hash.hex()}: tier {source.name} is down")
            # The tier lost it (a corrupt file is quarantined, a shared key expired or was
            # evicted by its server): forget that copy, try lower.
            with self.lock:
                self.counters.corrupt_reads += 1
                self.drop_from_tier(meta, tier)
        with self.lock:
            self.counters.loaded_bytes += meta.nbytes
        if promote and tier > 0:
            with self.lock:
                first = block_hash not in self.promoting
                if first:
                    event = self.promoting[block_hash] = threading.Event()
            if first:
                try:
                    if self.place(meta, data, 0, stop=tier, wait=False) is not None:
                        with self.lock:
                            self.counters.promotions += 1
                finally:
                    with self.lock:
                        self.promoting.pop(block_hash, None)
                    event.set()
        return data

    def copy_into(
        self,
        meta: BlockMeta,
        target: int,
        admits: Admits | None = None,
        data: Payload | None = None,
    ) -> bool:
        """Copy a (pinned) block held in other tiers into tier ``target``, once however many
        callers ask at the same time (the others wait for the first); True when it is there.
        ``admits``: who may be evicted for it (``place``); ``data``: its payload, read from
        the fastest other tier holding it already (a read ahead)."""
        block_hash = meta.block_hash
        while True:
            with self.lock:
                event = self.promoting.get(block_hash)
                if event is None:
                    if target in meta.tiers:
                        return True
                    sources = sorted(t for t in meta.tiers if t != target)
                    if not sources:
                        return False
                    event = self.promoting[block_hash] = threading.Event()
                    break
            event.wait()
        try:
            if data is None:
                data = self.tiers[sources[0]].get(block_hash)
            if data is None:
                return False  # that tier lost it (or is down): a later read forgets the copy
            placed = self.place(meta, data, target, stop=target + 1, wait=False, admits=admits)
            if placed is not None:
                with self.lock:
                    self.counters.promotions += 1
            return placed is not None
        finally:
            with self.lock:
                self.promoting.pop(block_hash, None)
            event.set()


class StorePart:
    """One of a ``TieredStore``'s parts (its reads, writes or recovery): operations over the
    ``StoreCore`` that the parts share."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core
