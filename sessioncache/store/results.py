"""What the store hands out and keeps count of: matches, writes and their results, located
slots, counters and figures."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Final, NamedTuple

from sessioncache.errors import (
    InvalidInput,
)
from sessioncache.hashing import BlockHash
from sessioncache.status import BlockStatus
from sessioncache.store.blocks import BlockMeta
from sessioncache.store.index import Lease
from sessioncache.tiers.base import (
    SlotLocation,
    StagedSlot,
)

DEFAULT_TTL_S = 3 * 24 * 3600.0
"""Blocks stored without a TTL live three days past their last access (the agent default)."""

_PLACE_ATTEMPTS = 8


@dataclass(slots=True, eq=False)
class Ticket:
    """A block queued for the durable tier (``store.behind``): ``done`` once its copy there is
    made (``ok``) or failed."""

    nbytes: int
    tenant: str
    urgent: bool = False
    """A durable store waits for it."""
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    others_before: int = 0
    """(urgent ones) The bytes of other tenants' blocks the queue had taken out when it was
    queued (``WriteBehind.waited_behind``)."""


class Match(NamedTuple):
    """The longest cached prefix of a lookup."""

    hashes: list[BlockHash]
    """The matched ids, root first."""
    tiers: list[str]
    """For each matched block, the fastest tier holding it."""
    lease: Lease | None
    cut: str | None = None
    """The bound that cut the match, and its lease, short of what is held (``pin_share``:
    leasing more would pass the tenant's share of a tier); None when nothing did."""

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


class Sync:
    """One request's durability: the durable tier its blocks must reach before it answers
    (None: it asked for none), and its blocks queued for that tier, not waited for yet
    (``StoreWrites.settle``). Its own: the requests filling one write never share one."""

    __slots__ = ("_lock", "_tickets", "durable_tier")

    def __init__(self, durable_tier: int | None = None) -> None:
        self.durable_tier: Final = durable_tier
        self._tickets: list[tuple[BlockHash, Ticket]] = []
        self._lock = threading.Lock()  # a request's blocks may be filled from several threads

    def add(self, block_hash: BlockHash, ticket: Ticket) -> None:
        with self._lock:
            self._tickets.append((block_hash, ticket))

    def take(self) -> list[tuple[BlockHash, Ticket]]:
        """The tickets added since the last ``take``."""
        with self._lock:
            tickets, self._tickets = self._tickets, []
        return tickets


@dataclass(eq=False)
class Write:
    """A prepared write of one chain segment (``TieredStore.prepare``). Its blocks are filled
    one of two ways:

    - ``fill(write, i, payload)``: the caller hands block ``i``'s payload (``put``, a REST
      upload, a block read off the stream);
    - ``reserve(write)`` gives each block not held yet a slot in the shared-memory tier, which
      another process fills in place, and ``publish(write, ...)`` verifies and publishes the
      next of them, in order (a same-host stage and its commits); ``abort`` frees the rest.

    Either way a filled block is written through (to the write-through tiers, and for a
    durable request to the first durable tier before it answers) by the same code, and
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
    """The plan's durable tier (None: not durable); a request filling some of its blocks may
    ask for more (``StoreWrites.sync_for``), never for less."""
    op: int
    at: float
    """The operation's instant: its records share it (creation, access and expiry times)."""
    status: list[BlockStatus | None] = field(default_factory=list)
    next_use: float | None = None
    """The forecast of the records it makes (``sessioncache.store.forecast``); None: each starts
    with its parent's."""
    slots: list[StagedSlot | None] = field(default_factory=list)
    metas: list[BlockMeta | None] = field(default_factory=list)
    open: bool = True
    claimed: int = 0
    """Staged blocks a ``publish`` took so far (done or under way): the next starts here."""
    broken: bool = False
    """A staged block was rejected: every later one is dropped."""
    sync: Sync = field(init=False)
    """The durability of the request filling all of the write (``put``, a stream STORE, a
    staging's commits): ``durable_tier`` and its blocks queued for it."""

    def __post_init__(self) -> None:
        self.sync = Sync(self.durable_tier)

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
    room_bytes: int
    """What it could hold now: its capacity, or less where its filesystem has less room."""


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
    demotions_refused: int = 0
    """Victims kept in their tier: the tier below could not take them."""
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


MAX_TTL_S = 10 * 365 * 86400.0
"""The longest TTL of a block or a session: ten years (an infinite one never expires)."""


def check_ttl(ttl_s: float) -> float:
    """A TTL in seconds: positive, finite and at most ``MAX_TTL_S``."""
    if (
        isinstance(ttl_s, bool)
        or not isinstance(ttl_s, int | float)
        or not 0 < ttl_s <= MAX_TTL_S  # False for NaN too
    ):
        raise InvalidInput(
            f"a TTL must be a number of seconds in (0, {MAX_TTL_S:.0f}], got {ttl_s!r}"
        )
    return float(ttl_s)


def held(status: BlockStatus | None) -> bool:
    return status is not None and status.held
