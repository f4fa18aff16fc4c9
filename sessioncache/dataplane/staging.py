"""A same-host connection's staging memory: where its client writes the blocks it stores.

Published blocks live in the CPU tier's segments, which clients map read-only (the node seals
them against every new writable mapping, ``tiers.cpu``). A STAGE reserves a published slot per
new block as before, and hands the client a slot here instead: memory of this connection
alone, in memfd segments of their own, mapped writable by the client. A COMMIT copies each
staged block into its published slot (memory only the node writes), checksums that copy, and
publishes it only if it matches what the client says it wrote. So no client, trusted or not,
can change a published block, and none can touch another connection's stagings: their
segments are handed only to the connection that owns them.

Memory: chunks of ``chunk_bytes`` (or one block, if larger), each used by one staging at a
time; a staging's blocks lie in its chunks back to back. A chunk freed by a COMMIT or ABORT
is kept for the next staging, up to ``keep_chunks`` (four: 256 MiB); the rest are unmapped
at once. All of
them go with the connection.

New chunks come from a server's ``staging_spares`` where it has one: chunks made and faulted in
ahead by a background thread, each handed to one connection only and never back to another
(a peer keeps its mappings of its connection's chunks after it goes).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from sessioncache.dataplane.slots import copy_and_hash
from sessioncache.tiers.base import SlotLocation
from sessioncache.tiers.cpu import shared_segment
from sessioncache.tiers.spares import SparePool

DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_KEEP_CHUNKS = 4
"""256 MiB: what one STAGE of ``SameHostClient`` reserves at most (``segment_bytes``)."""

STAGING_SEGMENT_BASE = 1 << 31
"""Staging segment ids count up from here, apart from the CPU tier's (which count from 1)."""

_ids: Iterator[int] = itertools.count(STAGING_SEGMENT_BASE)  # never reused in the process


@dataclass(slots=True)
class _Chunk:
    segment: int
    fd: int
    memory: torch.Tensor  # flat uint8, the node's writable mapping


@dataclass(slots=True)
class Region:
    """One staging's slots: block ``i`` of the staging (one it stores) at ``locations[i]``."""

    chunks: list[_Chunk] = field(default_factory=list)
    locations: dict[int, SlotLocation] = field(default_factory=dict)
    views: dict[int, torch.Tensor] = field(default_factory=dict)

    def copy_out(self, i: int, dst: torch.Tensor) -> int:
        """Copy block ``i`` into ``dst``; the XXH3-64 of what ``dst`` now holds, hashed from
        ``dst`` itself as it is copied (``dataplane.slots``)."""
        return copy_and_hash(dst.numpy(), self.views[i].numpy())


def _new_chunk(nbytes: int, name: str = "staging") -> _Chunk:
    segment = next(_ids)
    if segment >= 1 << 32:
        raise RuntimeError("staging segment ids are used up")
    fd, memory = shared_segment(f"sessioncache-{name}-{segment}", nbytes)
    return _Chunk(segment, fd, memory)


def _spare_chunk(nbytes: int, ahead: bool) -> _Chunk:
    return _new_chunk(nbytes)


def _drop_chunk(chunk: _Chunk) -> None:
    os.close(chunk.fd)  # the mapping goes with the tensor


def staging_spares(target: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> SparePool[_Chunk]:
    """Up to ``target`` staging chunks made ahead for a server's connections (module
    docstring); ``start`` it, ``close`` it with the server."""
    return SparePool(
        _spare_chunk,
        _drop_chunk,
        chunk_bytes=chunk_bytes,
        capacity_bytes=target * chunk_bytes,
        target=target,
        name="sessioncache-staging",
    )


class StagingMemory:
    """The staging chunks of one connection (module docstring). Not thread-safe: one
    connection serves one request at a time."""

    def __init__(
        self,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        keep_chunks: int = DEFAULT_KEEP_CHUNKS,
        name: str = "staging",
        spares: SparePool[_Chunk] | None = None,
    ) -> None:
        self._chunk_bytes = chunk_bytes
        self._keep = keep_chunks
        self._name = name
        self._spares = spares if spares is not None and spares.chunk_bytes == chunk_bytes else None
        self._used: dict[int, _Chunk] = {}
        self._free: list[_Chunk] = []

    def ahead(self, count: int = 1) -> None:
        """Hold ``count`` free chunks (at most ``keep_chunks``) before a STAGE needs them."""
        while len(self._free) < min(count, self._keep):
            self._free.append(self._make(self._chunk_bytes))

    def take(self, blocks: list[int], nbytes: int) -> Region:
        """Slots of ``nbytes`` for the staging's blocks ``blocks`` (the ones it stores)."""
        region = Region()
        per = max(1, self._chunk_bytes // nbytes)
        try:
            for first in range(0, len(blocks), per):
                chunk = self._chunk(max(self._chunk_bytes, nbytes))
                region.chunks.append(chunk)
                for k, i in enumerate(blocks[first : first + per]):
                    offset = k * nbytes
                    region.locations[i] = SlotLocation(chunk.segment, offset, nbytes)
                    region.views[i] = chunk.memory[offset : offset + nbytes]
        except BaseException:
            self.give(region)
            raise
        return region

    def give(self, region: Region) -> None:
        """The staging is over (committed, aborted): its chunks are free."""
        for chunk in region.chunks:
            if self._used.pop(chunk.segment, None) is None:
                continue
            if len(self._free) < self._keep and chunk.memory.numel() == self._chunk_bytes:
                self._free.append(chunk)
            else:
                os.close(chunk.fd)  # the mapping goes with the tensor
        region.chunks.clear()
        region.views.clear()

    def segments(self) -> list[int]:
        """This connection's segments: in use by open stagings, or kept for the next."""
        return sorted([*self._used, *(c.segment for c in self._free)])

    def segment_fd(self, segment: int) -> int:
        """A new descriptor of one of this connection's segments (``KeyError`` otherwise;
        the caller closes it)."""
        chunk = self._used.get(segment)
        if chunk is None:
            chunk = next((c for c in self._free if c.segment == segment), None)
        if chunk is None:
            raise KeyError(segment)
        return os.dup(chunk.fd)

    def close(self) -> None:
        for chunk in [*self._used.values(), *self._free]:
            os.close(chunk.fd)
        self._used.clear()
        self._free.clear()

    def _chunk(self, nbytes: int) -> _Chunk:
        if nbytes == self._chunk_bytes and self._free:
            chunk = self._free.pop()
        else:
            chunk = self._make(nbytes)
        self._used[chunk.segment] = chunk
        return chunk

    def _make(self, nbytes: int) -> _Chunk:
        """A chunk never handed out: a spare where one is made (or being made), else new."""
        if self._spares is not None and nbytes == self._chunk_bytes:
            chunk, held = self._spares.take(nbytes)
            self._spares.give_back(held)  # this connection's from now on: the pool refills
            return chunk
        return _new_chunk(nbytes, self._name)
