"""Reusable receive buffers for block uploads (REST PUTs and data-plane STOREs).

A fresh buffer per upload costs a page fault per 4 KiB on first touch, which on virtual
machines is slower than the copy itself (bench/tiers.py vs bench/transfer.py). Uploads of one
deployment all have the same payload size, so a handful of buffers per size, reused, keep
uploads in memory the process has already faulted in. The store copies a payload into its
tier before ``put`` returns, so a buffer is free again as soon as the upload is done.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class BufferPool:
    """Bytearrays by exact size, at most ``max_bytes`` kept idle."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self._max = max_bytes
        self._idle: dict[int, list[bytearray]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()

    @contextmanager
    def borrow(self, size: int) -> Iterator[bytearray]:
        with self._lock:
            free = self._idle.get(size)
            if free:
                buf = free.pop()
                self._idle_bytes -= size
            else:
                buf = bytearray(size)
        try:
            yield buf
        finally:
            with self._lock:
                if self._idle_bytes + size <= self._max:
                    self._idle.setdefault(size, []).append(buf)
                    self._idle_bytes += size
