"""A pool of reusable bytearrays, by exact size.

A fresh buffer costs a page fault per 4 KiB on first touch, which on virtual machines is slower
than the copy into it (docs/benchmarks.md). The blocks of one deployment all
have the same payload size, so a handful of buffers per size, reused as they are, keep copies
in memory the process has already faulted in. Used for block uploads (REST PUTs in
``api/routes/blocks.py``, data-plane STOREs) and
for the values the Redis tier assembles (``tiers/redis_writer.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from sessioncache.errors import InvalidInput

__all__ = ["BufferPool", "Filling"]

FIRST_PIECE = 1 << 20
"""A buffer filled from the network starts this big (or the whole size, if smaller) and
doubles as bytes arrive."""


class BufferPool:
    """Bytearrays by exact size, at most ``max_bytes`` kept idle. Thread-safe."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self._max = max_bytes
        self._idle: dict[int, list[bytearray]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        """An idle buffer of ``size`` bytes (its old contents), or a new zeroed one."""
        idle = self.take_idle(size)
        return bytearray(size) if idle is None else idle

    def take_idle(self, size: int) -> bytearray | None:
        """An idle buffer of ``size`` bytes (its old contents), or None."""
        with self._lock:
            free = self._idle.get(size)
            if free:
                self._idle_bytes -= size
                return free.pop()
        return None

    def give(self, buffers: Iterable[bytearray]) -> None:
        """Return buffers for reuse; those that would take the pool past ``max_bytes`` are
        dropped."""
        with self._lock:
            for buf in buffers:
                if self._idle_bytes + len(buf) <= self._max:
                    self._idle.setdefault(len(buf), []).append(buf)
                    self._idle_bytes += len(buf)

    @contextmanager
    def borrow(self, size: int) -> Iterator[bytearray]:
        """``take`` a buffer for the ``with`` block, ``give`` it back after."""
        buf = self.take(size)
        try:
            yield buf
        finally:
            self.give([buf])


class Filling:
    """A buffer for a body of a declared ``size``, as big as the bytes received so far need
    (doubling from ``FIRST_PIECE``), or an idle pooled one of that size: a client that
    declares a large body and sends little costs the node little. ``charge`` is told of every
    byte of buffer made (``inflight.Charge``); a pooled buffer is charged whole. Give the
    buffer back with ``pool.give`` once done with it."""

    def __init__(
        self, pool: BufferPool, size: int, charge: Callable[[int], None] | None = None
    ) -> None:
        self.size = size
        self.filled = 0
        self._charge = charge
        idle = pool.take_idle(size)
        if idle is not None:
            self._note(size)
            self.buf = idle
        else:
            first = min(size, FIRST_PIECE)
            self._note(first)
            self.buf = bytearray(first)

    def _note(self, nbytes: int) -> None:
        if self._charge is not None:
            self._charge(nbytes)

    def room(self) -> memoryview:
        """A view of the buffer past the bytes filled, growing it when they fill it (empty
        once ``size`` bytes are in). Release the view before the next call."""
        if self.filled == len(self.buf) < self.size:
            grown = min(self.size, 2 * len(self.buf))
            self._note(grown - len(self.buf))
            bigger = bytearray(grown)
            bigger[: self.filled] = self.buf
            self.buf = bigger
        return memoryview(self.buf)[self.filled :]

    def wrote(self, nbytes: int) -> None:
        self.filled += nbytes

    def append(self, chunk: bytes | memoryview) -> None:
        """Add ``chunk`` (``InvalidInput`` if it runs past ``size``)."""
        if self.filled + len(chunk) > self.size:
            raise InvalidInput(f"body longer than its declared {self.size} bytes")
        while chunk:
            with self.room() as room:
                n = min(len(room), len(chunk))
                room[:n] = chunk[:n]
            self.wrote(n)
            chunk = chunk[n:]

    @property
    def full(self) -> bool:
        return self.filled == self.size
