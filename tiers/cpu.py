"""The CPU tier: host-memory slabs of fixed-size slots, pinned when CUDA is present so that
device copies run at full PCIe speed; ``get`` hands out zero-copy views.

Pinning needs CUDA (without it torch refuses ``pin_memory=True``); ``tests/gpu`` runs the
tiers on a GPU where one is present, and unpinned in CI.

``SharedCpuTier`` is the same tier over shared memory, for engines on the node's host (the
same-host data path, ``docs/dataplane.md``): each chunk is one anonymous memory file
(``memfd_create``) mapped into the node, a *segment* with a small integer id. A process the
node hands a segment's descriptor to (over its Unix socket, ``SCM_RIGHTS``) maps the same
pages, read-only: a segment is sealed against every writable mapping but the node's own
(``F_SEAL_FUTURE_WRITE``), so no peer can change a block under its readers; peers write the
blocks they store into staging memory of their own (``dataplane.staging``), which the node
copies into a reserved slot at COMMIT. Nothing has a name in
``/dev/shm``: the kernel frees a segment with its last descriptor and mapping, so a node killed
with ``kill -9`` leaves nothing behind. With ``register_cuda`` (a node with a GPU tier), each
segment is registered with CUDA (``sessioncache.hostpin``) as it is made, so that the node's
copies between it and the GPU tier run at pinned speed; same-host clients register their own
mappings of it for theirs. A segment is unregistered before it is retired.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import itertools
import mmap
import os
import weakref
from collections.abc import Iterable, Sequence
from typing import Unpack

import torch

from sessioncache.errors import PayloadSizeError, TierFull
from sessioncache.hashing import BlockHash
from sessioncache.hostpin import HostRegistration
from sessioncache.tiers.base import SlotLocation, StagedSlot
from sessioncache.tiers.slab import ChunkOptions, SlabTier, _Chunk, _Memory, _Slab, _Slot

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)  # Linux 5.1; not in fcntl

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
"""A segment's size is fixed once made: a peer holding its descriptor cannot truncate it
under the node (which would kill the node with SIGBUS on its next access)."""

_SEALS_READ_ONLY = _SEALS | F_SEAL_FUTURE_WRITE
"""Also no write and no writable mapping from now on, through any descriptor, ``mprotect``
included; the node's mapping, made before the seal, stays writable."""


MADV_POPULATE_WRITE = 23
"""Linux 5.14: fault the range in, writable (not in Python's ``mmap`` module)."""


def shared_segment(name: str, nbytes: int, *, read_only: bool = False) -> tuple[int, torch.Tensor]:
    """A new memfd segment of ``nbytes``, sized for good, mapped writable into this process
    and populated: its descriptor and a flat ``uint8`` tensor over the mapping. With
    ``read_only`` every other mapping of it can only read.

    Its pages are transparent huge pages where the kernel allows them for shared memory
    (``/sys/kernel/mm/transparent_hugepage/shmem_enabled``: ``advise``, ``within_size`` or
    ``always``), else 4 KiB ones."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        memory = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        _populate(memory, fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS_READ_ONLY if read_only else _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd, torch.frombuffer(memory, dtype=torch.uint8)


def _populate(memory: mmap.mmap, fd: int, nbytes: int) -> None:
    """Fault a new segment's pages in now (as a pinned allocation would be): no page faults
    on the data path. Huge pages asked for first (refused or ignored where not allowed)."""
    with contextlib.suppress(OSError, AttributeError):
        memory.madvise(mmap.MADV_HUGEPAGE)
    try:
        memory.madvise(MADV_POPULATE_WRITE)
    except OSError:  # a kernel before 5.14: a populated mapping of the same pages instead
        mmap.mmap(
            fd,
            nbytes,
            flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        ).close()


@functools.cache
def _seals_work() -> bool:
    try:
        fd, _ = shared_segment("sessioncache-probe", mmap.PAGESIZE, read_only=True)
    except OSError:
        return False  # a kernel before 5.1: no F_SEAL_FUTURE_WRITE
    os.close(fd)
    return True


def shared_memory_available() -> bool:
    """Whether this platform has what ``SharedCpuTier`` needs (Linux 5.1: memfd, its seals,
    SCM_RIGHTS)."""
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and _seals_work()


def _close_all(fds: dict[int, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


class CpuTier(SlabTier):
    """Host slabs (see ``tiers.slab``)."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        name: str = "cpu",
        pin_memory: bool | None = None,
        **chunks: Unpack[ChunkOptions],
    ) -> None:
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        super().__init__(name, capacity_bytes, torch.device("cpu"), pin_memory=pin_memory, **chunks)
        if type(self) is CpuTier and chunks.get("preallocate", False):
            self._spares.fill()  # else ``make_ahead`` or the first chunk made starts it


class SharedCpuTier(CpuTier):
    """The CPU tier in memfd segments that same-host peers map (see the module docstring).

    Implements ``tiers.base.SharedMemoryTier``. Segment ids count up from 1 and are never
    reused while the tier lives, so a peer's mapping of a segment id always means the same
    memory; a chunk that the slab reclaims (entirely free) retires its segment.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        name: str = "cpu",
        register_cuda: bool = False,
        **chunks: Unpack[ChunkOptions],
    ) -> None:
        """``register_cuda``: register each segment with CUDA as it is made (for a node with
        a GPU tier: its copies to and from it; registering starts CUDA in the process)."""
        if not shared_memory_available():
            raise RuntimeError("a shared-memory CPU tier needs Linux (memfd_create)")
        super().__init__(capacity_bytes, name=name, pin_memory=False, **chunks)
        self._segment_ids = itertools.count(1)
        self._fds: dict[int, int] = {}
        self._registered: dict[int, HostRegistration] = {}  # segment: its CUDA registration
        self._register_cuda = register_cuda
        # A tier dropped without ``close`` still gives its descriptors back (its spares' too).
        weakref.finalize(self, _close_all, self._fds)
        weakref.finalize(self, self._spares.close)
        self._reserved: dict[SlotLocation, _Slot] = {}
        if chunks.get("preallocate", False):
            self._spares.fill()  # else ``make_ahead`` or the first chunk made starts it

    # -- segments -----------------------------------------------------------------------

    def segments(self) -> list[int]:
        with self._lock:
            return sorted(self._fds)

    def segment_fd(self, segment: int) -> int:
        """A new descriptor of the segment (a duplicate: the caller closes it)."""
        with self._lock:
            return os.dup(self._fds[segment])

    def _make_memory(self, nbytes: int, ahead: bool) -> _Memory:
        # Called by a put (lock held) or by the spares' thread (no lock): touches only the
        # id counter (``itertools.count`` is atomic) and new objects.
        segment = next(self._segment_ids)
        name = f"sessioncache-{self.name}-{segment}"
        fd, tensor = shared_segment(name, nbytes, read_only=True)
        pinned = HostRegistration.register(tensor, what=name) if self._register_cuda else None
        return _Memory(tensor, fd, segment, pinned)

    @staticmethod
    def _drop_memory(memory: _Memory) -> None:
        if memory.registration is not None:
            memory.registration.close()
        os.close(memory.fd)  # the mapping goes with the tensor

    def _adopt(self, memory: _Memory) -> None:
        self._fds[memory.segment] = memory.fd  # live from now on: peers may ask for it
        if memory.registration is not None:
            self._registered[memory.segment] = memory.registration

    def _retire_chunk(self, chunk: _Chunk) -> None:
        # The mapping goes with the tensor's last reference; the pages with the last mapping
        # or descriptor anywhere (a peer that mapped the segment keeps its copy alive).
        registration = self._registered.pop(chunk.segment, None)
        if registration is not None:
            registration.close()
        fd = self._fds.pop(chunk.segment, None)
        if fd is not None:
            os.close(fd)
        super()._retire_chunk(chunk)

    # -- where blocks lie ----------------------------------------------------------------

    def locate(self, block_hash: BlockHash) -> SlotLocation | None:
        with self._lock:
            code = self._index.get(block_hash)
            return None if code is None else _location(self._slabs, self._codes.unpack(code))

    # -- slots filled in place -----------------------------------------------------------

    def reserve(self, nbytes: int) -> StagedSlot:
        _check_reservable(self, nbytes)
        with self._lock:
            slot = self._allocate(nbytes)
            location = _location(self._slabs, slot)
            self._reserved[location] = slot
            chunk = self._slabs[nbytes].chunks[slot.chunk]
            assert chunk is not None
            return StagedSlot(location, chunk.tensor[slot.slot])

    def reserve_many(self, nbytes: int, count: int) -> list[StagedSlot]:
        """Up to ``count`` free slots of ``nbytes`` at once: as many as there is room for
        without eviction (maybe none)."""
        if count <= 0:
            return []
        _check_reservable(self, nbytes)
        staged: list[StagedSlot] = []
        with self._lock:
            slabs, reserved = self._slabs, self._reserved
            while len(staged) < count and self._can_allocate(nbytes):
                try:
                    slot = self._allocate(nbytes)
                except TierFull:
                    break
                chunk = slabs[nbytes].chunks[slot.chunk]
                assert chunk is not None
                location = SlotLocation(chunk.segment, slot.slot * nbytes, nbytes)
                reserved[location] = slot
                staged.append(StagedSlot(location, chunk.tensor[slot.slot]))
        return staged

    def publish_many(self, items: Sequence[tuple[BlockHash, StagedSlot]]) -> list[bool]:
        """Publish each reserved ``slot`` as the copy of its block ``id``, in order, under one
        lock: True where published, False where the block is held already (the slot freed);
        ``KeyError`` for a slot not reserved."""
        done: list[bool] = []
        with self._lock:
            index, pending, reserved = self._index, self._pending, self._reserved
            for block_hash, slot in items:
                held = reserved.pop(slot.location, None)
                if held is None:
                    raise KeyError(f"{self.name}: slot {slot.location} is not reserved")
                if block_hash in index or block_hash in pending:
                    self._release(held)
                    done.append(False)
                else:
                    index[block_hash] = self._codes.pack(held)
                    done.append(True)
        return done

    def release_many(self, slots: Iterable[StagedSlot]) -> None:
        """Free reserved slots not published, under one lock (a slot no longer reserved is
        skipped)."""
        with self._lock:
            for slot in slots:
                held = self._reserved.pop(slot.location, None)
                if held is not None:
                    self._release(held)

    def close(self) -> None:
        with self._lock:
            self._reserved.clear()
        super().close()


def _check_reservable(tier: SharedCpuTier, nbytes: int) -> None:
    if nbytes <= 0 or nbytes > tier.capacity_bytes:
        raise PayloadSizeError(
            f"{tier.name}: payload of {nbytes} bytes does not fit a tier of "
            f"{tier.capacity_bytes} bytes"
        )


def _location(slabs: dict[int, _Slab], slot: _Slot) -> SlotLocation:
    """Where a slot lies: its chunk's segment, the offset there and the payload size."""
    chunk = slabs[slot.payload_size].chunks[slot.chunk]
    assert chunk is not None
    return SlotLocation(chunk.segment, slot.slot * slot.payload_size, slot.payload_size)
