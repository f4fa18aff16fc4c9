"""A pool of reusable bytearrays, by exact size.

A fresh buffer costs a page fault per 4 KiB on first touch, which on virtual machines is slower
than the copy into it (docs/benchmarks.md). The blocks of one deployment all
have the same payload size, so a handful of buffers per size, reused as they are, keep copies
in memory the process has already faulted in. Used for block uploads (REST PUTs and data-plane
STOREs) and for the values the Redis tier assembles (``tiers/redis.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

__all__ = ["BufferPool"]


class BufferPool:
    """Bytearrays by exact size, at most ``max_bytes`` kept idle. Thread-safe."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self._max = max_bytes
        self._idle: dict[int, list[bytearray]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        """An idle buffer of ``size`` bytes (its old contents), or a new zeroed one."""
        with self._lock:
            free = self._idle.get(size)
            if free:
                self._idle_bytes -= size
                return free.pop()
        return bytearray(size)

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
