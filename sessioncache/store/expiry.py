"""An expiry index: what is due by a time, found at a cost in proportion to what is due.

Keys are filed in buckets of ``width`` seconds by the time they expire; the bucket numbers are
kept in a heap. Filing never looks at the bucket again: a key whose expiry moves later (a touch
slides a TTL) stays where it was filed, and is filed again, at its new time, when its old bucket
comes due (lazily, as the eviction heaps re-key in ``eviction.py``). So a sweep visits the keys
of the buckets due by now (the expired ones, and those touched since they were filed: each touch
costs at most one re-filing per expiry it outlived), never the whole population; a key costs
one list slot here.

Callers decide what a due key means with a ``check(key, now)`` answering ``(value, again)``:
``value`` (not None) is returned as expired; ``again`` (not None) files the key again at that
time (at ``now``, or earlier: in the next sweep; so a pinned expired block is looked at each
sweep until unpinned). A key checked twice in one sweep (filed twice) is checked once.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

K = TypeVar("K")
V = TypeVar("V")


class ExpiryIndex(Generic[K]):
    """Keys bucketed by expiry time (see the module docstring). Not locked: its owner's lock
    guards it."""

    def __init__(self, width: float = 1.0) -> None:
        self._width = width
        self._buckets: dict[int, list[K]] = {}
        self._order: list[int] = []  # bucket numbers, a heap

    def __len__(self) -> int:
        return sum(len(keys) for keys in self._buckets.values())

    def add(self, key: K, at: float) -> None:
        """File ``key`` to come due at ``at`` (never expiring keys, ``inf``, are not filed)."""
        if at == math.inf:
            return
        number = math.floor(at / self._width)
        keys = self._buckets.get(number)
        if keys is None:
            keys = self._buckets[number] = []
            heapq.heappush(self._order, number)
        keys.append(key)

    def add_many(self, keys: Sequence[K], ats: npt.NDArray[np.float64]) -> None:
        """``add`` of each of ``keys`` at the time of the same index in ``ats``, a bucket at a
        time (a restart files every block it finds)."""
        where = np.flatnonzero(np.isfinite(ats))
        if not len(where):
            return
        numbers = np.floor(ats[where] / self._width).astype(np.int64)
        order = np.argsort(numbers, kind="stable")
        numbers, where = numbers[order], where[order]
        bounds = (np.flatnonzero(np.diff(numbers)) + 1).tolist()
        for begin, end in zip([0, *bounds], [*bounds, len(numbers)], strict=True):
            number = int(numbers[begin])
            filed = self._buckets.get(number)
            if filed is None:
                filed = self._buckets[number] = []
                heapq.heappush(self._order, number)
            filed.extend([keys[i] for i in where[begin:end].tolist()])

    def due(
        self, now: float, check: Callable[[K, float], tuple[V | None, float | None]]
    ) -> list[V]:
        """The values ``check`` gives for the keys due by ``now`` (see the module docstring)."""
        last = math.floor(now / self._width)
        seen: set[K] = set()
        found: list[V] = []
        again: list[tuple[K, float]] = []
        order, buckets = self._order, self._buckets
        while order and order[0] <= last:
            for key in buckets.pop(heapq.heappop(order)):
                if key in seen:
                    continue
                seen.add(key)
                value, at = check(key, now)
                if value is not None:
                    found.append(value)
                elif at is not None:
                    again.append((key, at))
        for key, at in again:  # after the loop: keys due again now wait for the next sweep
            self.add(key, at)
        return found
