"""The tier interface: where block payloads live.

A tier is a byte-bounded map from ``BlockHash`` to an opaque payload. It knows nothing of
chains, TTLs, pins or other tiers: the ``TieredStore`` decides what goes where and what leaves.
Every tier is safe to call from several threads at once.

Primitives (``Tier``):
    name            a short label ("gpu", "cpu", "disk", ...), unique within a store
    capacity_bytes  the byte budget the tier never exceeds
    used_bytes      bytes of payload currently held
    durable         True when a returned ``put`` survives a crash of the process
    fits(nbytes)    whether a payload of that size could be stored right now without evicting
    contains(h)     whether the block is held
    get(h)          the payload as a 1-D ``torch.uint8`` tensor (possibly a view into tier
                    memory, valid until the block is deleted), or None when absent
    put(item)       stores a copy of a ``PutItem``'s payload (id, payload, namespace root,
                    parent, expiry); raises ``TierFull`` when it does not fit and
                    ``PayloadSizeError`` for an empty or oversize payload; putting an id that is
                    already held is a no-op. ``parent`` (the previous block of the chain) and
                    ``expires_at`` (epoch seconds) are hints a tier may keep: the disk tier
                    records the parent, a shared tier expires the key
    delete(h)       drops the block, returning the bytes freed (0 when absent)
    keys()          a snapshot of the held ids
    close()         releases memory, file handles and threads

Optional abilities, each its own small protocol:
    ``RecoverableTier``  ``recovered()`` lists what a durable tier found on start
    ``BatchRecoverableTier`` ``recovered_batches()``, the same column by column
    ``CheckedTier``      ``problem()`` says why the tier cannot serve now (None when it can)
    ``SharedTier``       ``locate_many(ids)`` tells which blocks the fleet's shared tier holds
                         (without moving payloads), ``set_expiry_many`` raises their expiry
    ``CodedTier``        ``stored_by_root()``: per namespace root, the raw bytes held and the
                         bytes stored for them (a block codec's saving)
    ``RoomBoundTier``    ``room_bytes()``: what it could hold now, its capacity or less where
                         what it stands on has less room (a filesystem shared or smaller)
    ``SharedMemoryTier`` a host tier whose memory other processes on the host may map: where
                         a block lies (``locate``), the segments' descriptors, and slots a
                         writer fills in place before they are published as blocks
                         (``reserve``, ``publish_many``, ``release_many``); see
                         ``docs/dataplane.md``, "Same host"
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch

from sessioncache.hashing import BlockHash
from sessioncache.tiers.payload import Payload


class PutItem(NamedTuple):
    """One block to store: ``Tier.put``'s argument (``RedisTier.put_many`` takes a list).
    ``parent`` (the previous block of the chain) and ``expires_at`` (epoch seconds; None: the
    tier's default) are hints a tier may keep; ``checksum``, the payload's XXH3-64 (seed 0)
    when the store has it, spares a tier that checksums its copies a pass over the payload."""

    block_hash: BlockHash
    payload: Payload
    namespace_root: bytes
    parent: BlockHash | None = None
    expires_at: float | None = None
    checksum: int | None = None


@runtime_checkable
class Tier(Protocol):
    """The primitives every tier implements (see the module docstring)."""

    @property
    def name(self) -> str: ...

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    @property
    def durable(self) -> bool: ...

    def fits(self, nbytes: int) -> bool: ...

    def contains(self, block_hash: BlockHash) -> bool: ...

    def get(self, block_hash: BlockHash) -> torch.Tensor | None: ...

    def put(self, item: PutItem) -> None: ...

    def delete(self, block_hash: BlockHash) -> int: ...

    def keys(self) -> list[BlockHash]: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class RecoveredBlock:
    """A block a durable tier found on start: enough for the store to re-index it. Read-only
    by convention, not frozen: a restart makes one per block by the hundred thousand, and a
    frozen dataclass's ``__init__`` (``object.__setattr__`` per field) costs 4x as much."""

    block_hash: BlockHash
    namespace_root: bytes
    nbytes: int
    mtime: float
    parent: BlockHash | None = None
    ttl_s: float | None = None
    """The block's own TTL, where something recorded it (the catalog); None: the default."""
    expires_at: float | None = None
    """When it expires, where recorded; None: its last access plus its TTL."""
    stored_nbytes: int = -1
    """Bytes the tier holds for it, where a codec made them fewer (-1: ``nbytes``)."""


@dataclass(frozen=True, slots=True, eq=False)
class RecoveredBatch:
    """Recovered blocks column by column (a fast restart reads the catalog's rows so): row
    ``i`` is block ``ids[i]``. Made without a Python object per block beyond its ids, for a
    bulk adoption; ``blocks()`` gives the same as ``RecoveredBlock``s."""

    ids: list[BlockHash]
    """Distinct 16-byte ids: the very objects to keep as keys (the tier and the store share
    them)."""
    namespace_roots: list[bytes]
    """Each block's namespace root, one object per distinct root."""
    parents: list[BlockHash | None]
    nbytes: npt.NDArray[np.int64]
    mtime: npt.NDArray[np.float64]
    """The last access (``RecoveredBlock.mtime``), epoch seconds."""
    ttl_s: npt.NDArray[np.float64]
    """NaN where not recorded (``RecoveredBlock.ttl_s`` None: the store's default)."""
    expires_at: npt.NDArray[np.float64]
    """NaN where not recorded (``RecoveredBlock.expires_at`` None)."""

    def __len__(self) -> int:
        return len(self.ids)

    def blocks(self) -> Iterator[RecoveredBlock]:
        """The rows as ``RecoveredBlock``s, one number object per distinct size and TTL."""
        return map(
            RecoveredBlock,
            self.ids,
            self.namespace_roots,
            _interned(self.nbytes),
            self.mtime.tolist(),
            self.parents,
            _interned(self.ttl_s),
            _optional(self.expires_at),
        )

    @classmethod
    def of(cls, blocks: Sequence[RecoveredBlock]) -> RecoveredBatch:
        """``blocks`` as columns."""
        nan = float("nan")
        return cls(
            ids=[b.block_hash for b in blocks],
            namespace_roots=[b.namespace_root for b in blocks],
            parents=[b.parent for b in blocks],
            nbytes=np.array([b.nbytes for b in blocks], dtype=np.int64),
            mtime=np.array([b.mtime for b in blocks], dtype=np.float64),
            ttl_s=np.array([nan if b.ttl_s is None else b.ttl_s for b in blocks]),
            expires_at=np.array([nan if b.expires_at is None else b.expires_at for b in blocks]),
        )


def _interned(values: npt.NDArray[np.generic]) -> list[Any]:
    """``values.tolist()`` with one Python object per distinct value (few: sizes, TTLs), and
    None for NaN."""
    if not len(values):
        return []
    if (values == values[0]).all():
        return [values[0].item()] * len(values)
    distinct, codes = np.unique(values, return_inverse=True)
    objects = [None if v != v else v for v in distinct.tolist()]
    return list(map(objects.__getitem__, codes.tolist()))


def _optional(values: npt.NDArray[np.float64]) -> list[float | None]:
    """``values.tolist()`` with None for NaN."""
    out: list[float | None] = values.tolist()
    if np.isnan(values).any():
        out = [None if v != v else v for v in out]
    return out


@runtime_checkable
class RecoverableTier(Protocol):
    """A durable tier that rebuilt its index on start and can say what it found."""

    def recovered(self) -> Iterator[RecoveredBlock]: ...


@runtime_checkable
class BatchRecoverableTier(Protocol):
    """A durable tier that can say what it found on start column by column (a fast restart's
    catalog rows), for an owner that adopts them in bulk; ``recovered()`` is the same
    blocks one by one: an owner reads one or the other, once."""

    def recovered_batches(self) -> Iterator[RecoveredBatch]: ...


@runtime_checkable
class LazyStartTier(Protocol):
    """A durable tier that can start without reading its files (``DiskTier.open(...,
    scan=False)``): told what it holds by its owner, it finds the rest in a later pass."""

    def adopt(self, blocks: Iterable[RecoveredBlock]) -> None: ...

    def adopt_batch(self, batch: RecoveredBatch) -> None: ...

    def scan_unindexed(self) -> list[RecoveredBlock]: ...

    unscanned: bool
    """Opened without its scan, and ``scan_unindexed`` not done yet (``find_unindexed``
    reads the files a caller asks for meanwhile)."""

    def find_unindexed(self, hashes: Sequence[BlockHash]) -> list[RecoveredBlock]: ...

    def missing(self) -> list[BlockHash]: ...


@runtime_checkable
class GroupCommitTier(Protocol):
    """A durable tier that makes several blocks durable with one round of syncs
    (``DiskTier.put_group``): per item, None (stored or held) or the error ``put`` would
    raise; one item's error leaves the others stored."""

    def put_group(self, items: Sequence[PutItem]) -> list[Exception | None]: ...


@runtime_checkable
class CodedTier(Protocol):
    """A tier that may store blocks encoded (``sessioncache.codecs``)."""

    def stored_by_root(self) -> dict[bytes, tuple[int, int]]: ...


@runtime_checkable
class RoomBoundTier(Protocol):
    """A tier whose room is bounded by what it stands on as well as by its capacity: ``fits``
    answers against both, so that a full filesystem evicts by policy as a full budget does."""

    def room_bytes(self) -> int: ...


@runtime_checkable
class CheckedTier(Protocol):
    """A tier that can tell whether it is able to serve right now (for ``/readyz``)."""

    def problem(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class LocatedBlock:
    """What a shared tier knows of a block it holds, as ``locate_many`` reports it (no payload
    moved)."""

    block_hash: BlockHash
    namespace_root: bytes
    parent: BlockHash | None
    nbytes: int
    expires_at: float | None
    """Wall-clock expiry of the shared copy; None if the tier reports none."""


@runtime_checkable
class SharedTier(Protocol):
    """A tier shared by every node of a fleet (Redis): blocks other nodes stored can be found
    in it, and its keys expire on their own."""

    def locate_many(self, hashes: Sequence[BlockHash]) -> Sequence[LocatedBlock | None]: ...

    def set_expiry_many(self, items: Sequence[tuple[BlockHash, float]]) -> None: ...

    def corrupt_located(self) -> int:
        """Values ``locate_many`` found damaged since start (deleted, never adopted: the
        store counts them with its corrupt reads)."""
        ...


@dataclass(frozen=True, slots=True)
class SlotLocation:
    """Where a payload lies in a shared-memory tier: ``nbytes`` at ``offset`` of segment
    ``segment`` (a small integer, never reused while the tier lives)."""

    segment: int
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True, eq=False)
class StagedSlot:
    """A slot reserved for a writer: invisible to ``get``/``locate`` until published."""

    location: SlotLocation
    payload: torch.Tensor
    """A writable 1-D ``torch.uint8`` view of the slot (the node reads it to verify)."""


@runtime_checkable
class SharedMemoryTier(Protocol):
    """A host tier whose segments other processes map (the same-host data path).

    ``segments()`` the live segment ids; ``segment_fd(segment)`` a new descriptor of one
    (the caller closes it; ``KeyError`` when the segment is gone); ``locate(h)`` where a held
    block lies, or None. ``reserve(nbytes)`` takes a free slot (``TierFull``,
    ``PayloadSizeError`` as ``put``); ``reserve_many(nbytes, n)`` takes up to ``n``, as many
    as fit without eviction. ``publish_many([(h, slot), ...])`` makes each filled slot the
    block ``h`` without copying (False, and the slot freed, where ``h`` is already held);
    ``release_many(slots)`` frees unpublished slots. Each call takes the tier's lock once.
    """

    def segments(self) -> list[int]: ...

    def segment_fd(self, segment: int) -> int: ...

    def locate(self, block_hash: BlockHash) -> SlotLocation | None: ...

    def reserve(self, nbytes: int) -> StagedSlot: ...

    def reserve_many(self, nbytes: int, count: int) -> list[StagedSlot]: ...

    def publish_many(self, items: Sequence[tuple[BlockHash, StagedSlot]]) -> list[bool]: ...

    def release_many(self, slots: Iterable[StagedSlot]) -> None: ...
