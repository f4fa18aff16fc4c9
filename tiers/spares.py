"""Chunk memory made ahead of need: a slab tier's next chunks, created and faulted in by a
background thread so that the put (or STAGE) that needs a new chunk finds one ready.

Why: making a chunk is the kernel zeroing and mapping its pages. For a 64 MiB shared-memory
segment that took 40-90 ms on the two-core benchmark machine (``docs/benchmarks.md``, LMCache
section), on the critical path of whichever store first ran out of free slots; a store of
128 MiB of new blocks paid it twice. Made ahead, the cost moves to a thread that runs while
the store's payloads are being copied, or while the node is idle between requests.

The pool holds at most ``target`` spare chunks of ``chunk_bytes`` each, and only while the
memory the tier holds (its chunks, the spares, the ones being made) leaves room for one more
chunk within its capacity: spares never take the tier over its capacity. ``target`` may be
"as many as fit" (``fill``), which makes the whole tier at once (``preallocate``).

A spare is taken for a chunk of more than half ``chunk_bytes`` and at most ``chunk_bytes``;
a chunk of another size (a slab's first, small ones, the last one that fills the capacity, or
one bigger than ``chunk_bytes`` for a block bigger than it) is made when needed, after
dropping spares if it needs their room: a small chunk never holds a whole spare's memory.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger("sessioncache.tiers.spares")

M = TypeVar("M")


class SparePool(Generic[M]):
    """Spare chunk memory of one tier (see the module docstring). Thread-safe.

    ``make(nbytes, ahead)`` makes memory of ``nbytes`` (``ahead``: a spare, to be faulted in
    now: that is the point; else for a chunk needed now); ``drop(m)``
    gives up memory that was never handed out. ``make`` is held weakly (a tier's bound
    method: the pool must not keep its tier alive), ``drop`` strongly (a plain function)."""

    def __init__(
        self,
        make: Callable[[int, bool], M],
        drop: Callable[[M], None],
        *,
        chunk_bytes: int,
        capacity_bytes: int,
        target: int,
        name: str,
    ) -> None:
        if target < 0:
            raise ValueError(f"target must be >= 0, got {target}")
        self._make_ref: Callable[[], Callable[[int, bool], M] | None] = (
            weakref.WeakMethod(make) if hasattr(make, "__self__") else (lambda: make)  # type: ignore[arg-type]
        )
        self._drop = drop
        self.chunk_bytes = chunk_bytes
        self.capacity_bytes = capacity_bytes
        self.target = target
        self.name = name
        self._cond = threading.Condition()
        self._spares: list[M] = []
        self._making = 0
        self._held = 0  # bytes: chunks handed out + spares + spares being made
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- what the tier asks ------------------------------------------------------------------

    @property
    def spare_count(self) -> int:
        with self._cond:
            return len(self._spares)

    @property
    def held_bytes(self) -> int:
        """Bytes of memory made: chunks in use, spares, spares being made."""
        with self._cond:
            return self._held

    def take(self, nbytes: int) -> tuple[M, int]:
        """Memory for a new chunk of ``nbytes``, and the size of that memory (a spare's is
        ``chunk_bytes``, maybe more than asked): a spare if one is ready or being made (waits
        for it), else made now in the caller's thread. Then the pool refills itself."""
        with self._cond:
            if self.chunk_bytes // 2 < nbytes <= self.chunk_bytes:
                # A spare being made is nearer to ready than a new one made beside it (which
                # would also compete with it for the same cores and memory bandwidth).
                while not self._spares and self._making and not self._closed:
                    self._cond.wait()
                if self._spares:
                    memory = self._spares.pop()
                    self._kick()
                    return memory, self.chunk_bytes
            while self._spares and self._held + nbytes > self.capacity_bytes:
                self._drop(self._spares.pop())  # its room is needed for this chunk
                self._held -= self.chunk_bytes
            self._held += nbytes
        try:
            make = self._make_ref()
            if make is None:
                raise RuntimeError(f"{self.name}: the tier is gone")
            memory = make(nbytes, False)
        except BaseException:
            with self._cond:
                self._held -= nbytes
            raise
        with self._cond:
            self._kick()
        return memory, nbytes

    def give_back(self, nbytes: int) -> None:
        """A chunk of ``nbytes`` (as ``take`` said) left the tier: its room may be refilled."""
        with self._cond:
            self._held -= nbytes
            self._kick()

    def fill(self) -> None:
        """Make spares up to the target in the caller's thread (``preallocate``), then wait
        for any being made in the background."""
        self._run(background=False)
        with self._cond:
            while self._making and not self._closed:
                self._cond.wait()

    def start(self) -> None:
        """Start making spares in the background (if the target asks for any)."""
        with self._cond:
            self._kick()

    def close(self) -> None:
        """Drop every spare; spares being made are dropped when done. Idempotent."""
        with self._cond:
            self._closed = True
            while self._spares:
                self._drop(self._spares.pop())
                self._held -= self.chunk_bytes
            self._cond.notify_all()

    # -- the refill ------------------------------------------------------------------------

    def _wanted(self) -> bool:
        """Another spare is wanted and fits (call with the condition held)."""
        return (
            not self._closed
            and len(self._spares) + self._making < self.target
            and self._held + self.chunk_bytes <= self.capacity_bytes
        )

    def _kick(self) -> None:
        """Start the refill thread if a spare is wanted and none runs (condition held)."""
        if self._thread is None and self._wanted():
            self._thread = threading.Thread(
                target=self._run, name=f"{self.name}-spares", daemon=True
            )
            self._thread.start()

    def _run(self, background: bool = True) -> None:
        while True:
            with self._cond:
                if not self._wanted():
                    if background:
                        self._thread = None
                    return
                self._making += 1
                self._held += self.chunk_bytes
            memory: M | None = None
            try:
                make = self._make_ref()
                if make is not None:
                    memory = make(self.chunk_bytes, True)
            except Exception:
                # Out of memory or descriptors: the chunk will be made when needed (and fail
                # there, with the error going to the caller that needed it).
                log.exception("%s: making a spare chunk failed", self.name)
            with self._cond:
                self._making -= 1
                if memory is None or self._closed:
                    self._held -= self.chunk_bytes
                    if memory is not None:
                        self._drop(memory)
                    if background:
                        self._thread = None
                    self._cond.notify_all()
                    return
                self._spares.append(memory)
                self._cond.notify_all()
