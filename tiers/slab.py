"""Fixed-size-slot slabs in torch memory: the machinery shared by the GPU and CPU tiers.

Memory is carved into one slab per payload size in use. A slab grows chunk by chunk (one torch
tensor of ``slots x payload_size`` bytes) while the tier's allocation stays within its capacity,
and freed slots are reused before anything new is allocated. A slab's chunks grow
geometrically once the tier holds another payload size: its first holds one slot, each next
one as many as the slab holds already, up to ``chunk_bytes``. So every payload size but the
first costs at most twice what its blocks use: a few blocks of many sizes, held or pinned,
cannot squat the tier's capacity in mostly empty chunks, while the usual deployment's one
size gets whole chunks (made ahead of need, ``spare_chunks``) from its first store. A chunk
that falls entirely free may be released so that another payload size can grow; in the usual
deployment (one model, one KV layout) there is a single payload size and a single slab.

``get`` returns a view into the slot: zero-copy, valid until the block is deleted from the tier
(the store leases blocks across a load so that this cannot happen under a reader).

A tier may make its next chunks ahead of need (``spare_chunks``) or all of them at once
(``preallocate``): see ``tiers.spares``. A chunk is then a view of a spare's memory.

Copies that involve a device (a put into a GPU tier's slot, or of a GPU tier's block into a
host tier's) run on the device's copy stream and are complete before the block is published
(``sessioncache.devices``). ``tests/gpu`` runs the same paths on ``cpu`` in CI and on ``cuda``
where a GPU is present.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Final, NamedTuple, TypedDict

import numpy as np
import torch

from sessioncache.devices import DeviceCopies, cuda_device
from sessioncache.errors import TierFull
from sessioncache.hashing import BlockHash
from sessioncache.hostpin import HostRegistration
from sessioncache.tiers.base import PutItem
from sessioncache.tiers.payload import as_byte_tensor, as_memoryview, checked_nbytes
from sessioncache.tiers.spares import SparePool

DEFAULT_CHUNK_BYTES = 64 << 20


class _Memory(NamedTuple):
    """Memory a chunk is carved from: a flat uint8 tensor, and for a shared-memory tier the
    descriptor and id of its segment."""

    tensor: torch.Tensor
    fd: int = -1
    segment: int = -1
    registration: HostRegistration | None = None  # its pages' CUDA registration, if any


@dataclass(slots=True)
class _Chunk:
    tensor: torch.Tensor  # shape (slots, payload_size), dtype uint8
    used: int = 0
    segment: int = -1  # shared-memory tiers: the chunk's segment id (see ``tiers.cpu``)
    memory_bytes: int = 0  # of the memory it is carved from (a spare's may be bigger)
    fresh: int = 0  # slots below this were handed out once; the rest never were


@dataclass(slots=True)
class _Slab:
    """All chunks of one payload size. A new chunk's slots are handed out in order from its
    ``fresh`` mark; a released slot goes to ``free`` and is reused first. Making a chunk is
    O(1) whatever its number of slots (a chunk of 1-byte slots has 64 Mi of them)."""

    payload_size: int
    chunks: list[_Chunk | None] = field(default_factory=list)
    free: list[tuple[int, int]] = field(default_factory=list)  # (chunk index, slot index)
    fresh: list[int] = field(default_factory=list)  # chunks with never-used slots left


@dataclass(frozen=True, slots=True)
class _Slot:
    payload_size: int
    chunk: int
    slot: int


_SLOT_BITS = 32
_CHUNK_BITS = 20
"""A held block's slot is kept as one int (``SlabTier._pack``): its slab's number, its chunk
and its slot index; a ``_Slot`` object per block would cost ~56 bytes more."""


class _SlotCodes:
    """Slots as ints (a held block's entry in the tier's map: one int, not a ``_Slot``):
    the slab's number, the chunk's index, the slot's index, packed."""

    def __init__(self) -> None:
        self._number: dict[int, int] = {}  # payload size: its slab's number
        self._sizes: list[int] = []  # slab number: its payload size

    def pack(self, slot: _Slot) -> int:
        assert slot.chunk >> _CHUNK_BITS == 0 and slot.slot >> _SLOT_BITS == 0
        number = self._number.get(slot.payload_size)
        if number is None:
            number = self._number[slot.payload_size] = len(self._sizes)
            self._sizes.append(slot.payload_size)
        return (number << _CHUNK_BITS | slot.chunk) << _SLOT_BITS | slot.slot

    def unpack(self, code: int) -> _Slot:
        chunk = code >> _SLOT_BITS
        return _Slot(
            self._sizes[chunk >> _CHUNK_BITS],
            chunk & ((1 << _CHUNK_BITS) - 1),
            code & ((1 << _SLOT_BITS) - 1),
        )


def _reuse_chunk_index(slab: _Slab) -> int:
    for i, chunk in enumerate(slab.chunks):
        if chunk is None:
            return i
    slab.chunks.append(None)
    return len(slab.chunks) - 1


class ChunkOptions(TypedDict, total=False):
    """How a slab tier makes its memory: ``SlabTier``'s keyword arguments of these names (and
    defaults), which the tiers built on it pass on."""

    chunk_bytes: int
    spare_chunks: int
    preallocate: bool
    grow_chunks: bool


class SlabTier:
    """A tier of fixed-size slots in torch tensors on one device (see module docstring)."""

    durable: Final = False

    def __init__(
        self,
        name: str,
        capacity_bytes: int,
        device: torch.device,
        *,
        pin_memory: bool = False,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        spare_chunks: int = 0,
        preallocate: bool = False,
        grow_chunks: bool = True,
    ) -> None:
        """``spare_chunks``: chunks of ``chunk_bytes`` made ahead of need by a background
        thread, within the capacity; ``preallocate``: make every chunk that fits now (the
        constructor returns once they are made), e.g. so that a node's first stores do not
        pay for its memory; its chunks are all ``chunk_bytes`` (the memory is made anyway).
        ``grow_chunks``: a slab's chunks grow from one slot (see the module docstring); False:
        every chunk is ``chunk_bytes``, as under ``preallocate``."""
        if spare_chunks < 0:
            raise ValueError(f"spare_chunks must be >= 0, got {spare_chunks}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.name: Final = name
        self.capacity_bytes: Final = capacity_bytes
        self.device: Final = device
        self._pin = pin_memory and device.type == "cpu"
        self._chunk_bytes = chunk_bytes
        self._grow = grow_chunks and not preallocate
        self._lock = threading.Lock()
        self._slabs: dict[int, _Slab] = {}
        self._index: dict[BlockHash, int] = {}
        """Each held block's slot, packed (``_SlotCodes``)."""
        self._codes = _SlotCodes()
        self._pending: set[BlockHash] = set()
        self._used = 0
        self._allocated = 0
        self._spares: SparePool[_Memory] = SparePool(
            self._make_memory,
            type(self)._drop_memory,
            chunk_bytes=chunk_bytes,
            capacity_bytes=capacity_bytes,
            target=capacity_bytes // chunk_bytes if preallocate else spare_chunks,
            name=f"sessioncache-{name}",
        )

    def make_ahead(self) -> None:
        """Start making the spare chunks now, in the background (a serving node's tier, from
        its start), instead of after the first chunk made."""
        self._spares.start()

    @property
    def spare_bytes(self) -> int:
        """Bytes made ahead of need (spare chunks), not in the tier's allocation yet."""
        return self._spares.spare_count * self._chunk_bytes

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def allocated_bytes(self) -> int:
        """Bytes of device memory the slabs hold, used or free."""
        return self._allocated

    def __len__(self) -> int:
        return len(self._index)

    def fits(self, nbytes: int) -> bool:
        with self._lock:
            return self._can_allocate(nbytes)

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    def keys(self) -> list[BlockHash]:
        with self._lock:
            return list(self._index)

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        with self._lock:
            code = self._index.get(block_hash)
            if code is None:
                return None
            slot = self._codes.unpack(code)
            chunk = self._slabs[slot.payload_size].chunks[slot.chunk]
            assert chunk is not None
            return chunk.tensor[slot.slot]

    def put(self, item: PutItem) -> None:
        block_hash, payload = item.block_hash, item.payload
        nbytes = checked_nbytes(payload, self.name, self.capacity_bytes)
        with self._lock:
            if block_hash in self._index or block_hash in self._pending:
                return
            slot = self._allocate(nbytes)
            self._pending.add(block_hash)
            chunk = self._slabs[nbytes].chunks[slot.chunk]
            assert chunk is not None
            dst = chunk.tensor[slot.slot]
        # The copy runs outside the lock so that puts of large blocks overlap; the slot is
        # reserved and the id invisible to readers until it is published below.
        try:
            if dst.device.type == "cpu" and cuda_device(payload) is None:
                # numpy's single-threaded memcpy: torch's copy_ splits a 2 MiB copy over its
                # intra-op threads, which contend with the server's own threads (measured
                # 5x slower in a serving process on two cores).
                np.copyto(dst.numpy(), np.frombuffer(as_memoryview(payload), dtype=np.uint8))
            else:
                # A device slot, or a device payload (a GPU tier's block demoted here): one
                # copy on the device's copy stream, complete before the block is published.
                with DeviceCopies() as copies:
                    copies.copy(dst, as_byte_tensor(payload))
        except BaseException:
            with self._lock:
                self._pending.discard(block_hash)
                self._release(slot)
            raise
        with self._lock:
            self._pending.discard(block_hash)
            self._index[block_hash] = self._codes.pack(slot)

    def delete(self, block_hash: BlockHash) -> int:
        with self._lock:
            code = self._index.pop(block_hash, None)
            if code is None:
                return 0
            slot = self._codes.unpack(code)
            self._release(slot)
            return slot.payload_size

    def close(self) -> None:
        with self._lock:
            self._index.clear()
            for slab in self._slabs.values():
                for chunk in slab.chunks:
                    if chunk is not None:
                        self._retire_chunk(chunk)
            self._slabs.clear()
            self._used = 0
            self._allocated = 0
            self._spares.close()

    # -- chunk memory (a subclass may allocate it elsewhere; called with the lock held) ----

    def _new_chunk(self, slots: int, payload_size: int) -> _Chunk:
        """A chunk of ``slots`` slots of ``payload_size`` bytes: a spare's memory (made ahead)
        when one is ready, else new memory."""
        size = slots * payload_size
        memory, held = self._spares.take(size)
        self._adopt(memory)
        tensor = memory.tensor[:size].view(slots, payload_size)
        return _Chunk(tensor, segment=memory.segment, memory_bytes=held)

    def _adopt(self, memory: _Memory) -> None:
        """``memory`` becomes a chunk of the tier (called with the lock held)."""

    def _make_memory(self, nbytes: int, ahead: bool) -> _Memory:
        """New memory of ``nbytes`` (called from the spares' thread too: no lock held there).
        Host memory made ``ahead`` (a spare) is faulted in here (zeroed), not by the first put
        into it; pinned memory is, by its allocation."""
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device, pin_memory=self._pin)
        if ahead and self.device.type == "cpu" and not self._pin:
            np.copyto(tensor.numpy(), 0)  # one thread: torch's fill_ would take every core
        return _Memory(tensor)

    @staticmethod
    def _drop_memory(memory: _Memory) -> None:
        """Give up memory never handed to a chunk (a spare); the tensor is dropped after this."""

    def _retire_chunk(self, chunk: _Chunk) -> None:
        """``chunk`` leaves the tier (reclaimed or closed); its tensor is dropped after this."""
        self._spares.give_back(chunk.memory_bytes)

    # -- allocation (call with the lock held) -------------------------------------------

    def _can_allocate(self, nbytes: int) -> bool:
        slab = self._slabs.get(nbytes)
        if slab is not None and (slab.free or slab.fresh):
            return True
        return self.capacity_bytes - self._allocated + self._reclaimable(nbytes) >= nbytes

    def _reclaimable(self, keep_size: int) -> int:
        """Bytes held by entirely free chunks of other payload sizes."""
        total = 0
        for size, slab in self._slabs.items():
            if size != keep_size:
                total += sum(c.tensor.numel() for c in slab.chunks if c is not None and not c.used)
        return total

    def _allocate(self, nbytes: int) -> _Slot:
        slab = self._slabs.get(nbytes)
        if slab is None:
            slab = self._slabs[nbytes] = _Slab(nbytes)
        if not slab.free and not slab.fresh:
            if self.capacity_bytes - self._allocated < nbytes:
                self._reclaim(keep_size=nbytes, need=nbytes)
            room = self.capacity_bytes - self._allocated
            if room < nbytes:
                raise TierFull(f"{self.name}: no free slot of {nbytes} bytes")
            grown = self._chunk_bytes
            if self._grow and any(
                size != nbytes and any(c is not None for c in other.chunks)
                for size, other in self._slabs.items()
            ):
                grown = max(nbytes, sum(c.tensor.numel() for c in slab.chunks if c is not None))
            slots = max(1, min(self._chunk_bytes, room, grown) // nbytes)
            index = _reuse_chunk_index(slab)
            slab.chunks[index] = self._new_chunk(slots, nbytes)
            self._allocated += slots * nbytes
            slab.fresh.append(index)
        if slab.free:
            chunk_index, slot_index = slab.free.pop()
            chunk = slab.chunks[chunk_index]
            assert chunk is not None
        else:
            chunk_index = slab.fresh[-1]
            chunk = slab.chunks[chunk_index]
            assert chunk is not None
            slot_index = chunk.fresh
            chunk.fresh += 1
            if chunk.fresh == chunk.tensor.shape[0]:
                slab.fresh.pop()
        chunk.used += 1
        self._used += nbytes
        return _Slot(nbytes, chunk_index, slot_index)

    def _release(self, slot: _Slot) -> None:
        slab = self._slabs[slot.payload_size]
        chunk = slab.chunks[slot.chunk]
        assert chunk is not None
        chunk.used -= 1
        self._used -= slot.payload_size
        slab.free.append((slot.chunk, slot.slot))

    def _reclaim(self, keep_size: int, need: int) -> None:
        """Free whole idle chunks of other payload sizes until ``need`` bytes can be allocated."""
        for size, slab in list(self._slabs.items()):
            if size == keep_size:
                continue
            for i, chunk in enumerate(slab.chunks):
                if chunk is None or chunk.used:
                    continue
                slab.chunks[i] = None
                slab.free = [(c, s) for c, s in slab.free if c != i]
                slab.fresh = [c for c in slab.fresh if c != i]
                self._allocated -= chunk.tensor.numel()
                self._retire_chunk(chunk)
                if self.capacity_bytes - self._allocated >= need:
                    return
