"""``TieredStore``: the store's core and its three parts, ``reads``, ``writes`` and ``recovery``
(the package docstring has the data flow)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Unpack

import numpy as np

from sessioncache.clock import Clock
from sessioncache.store.behind import WriteBehind
from sessioncache.store.core import StoreCore, StoreOptions
from sessioncache.store.events import DropObserver, StoreObserver
from sessioncache.store.eviction import EvictionPolicy
from sessioncache.store.forecast import Forecast
from sessioncache.store.prefetch import StorePrefetch
from sessioncache.store.reads import StoreReads
from sessioncache.store.recovery import StoreRecovery
from sessioncache.store.republish import Republisher
from sessioncache.store.results import (
    Counters,
    NamespaceUsage,
    StoreStats,
    TierStats,
)
from sessioncache.store.writes import StoreWrites
from sessioncache.tiers.base import (
    SharedMemoryTier,
    Tier,
)


class TieredStore:
    """A content-addressed block store over ``tiers`` (fastest first); see the module doc."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        policy: EvictionPolicy | None = None,
        **options: Unpack[StoreOptions],
    ) -> None:
        self._core = StoreCore(tiers, policy, **options)
        durable = self._core.first_durable(1) if len(self._core.tiers) > 1 else None
        if self._core.write_behind_bytes and durable is not None:
            self._core.behind = WriteBehind(
                self._core,
                durable,
                bound_bytes=self._core.write_behind_bytes,
                owner=self._core.write_behind_owner,
                tenant_share=self._core.write_behind_share,
            )
        self.republisher: Republisher | None = None
        """What the fleet's shared tier missed while unreachable, published once it answers."""
        shared = self._core.shared
        if shared is not None and shared[0] in self._core.write_through_tiers:
            self.republisher = Republisher(
                self._core, shared[0], self._core.write_behind_owner or (lambda root: "")
            )
            self._core.shared_missed = self.republisher.note
        self.recovery = StoreRecovery(self._core)
        """What durable tiers found, on start and while serving."""
        self.reads = StoreReads(self._core, self.recovery)
        """Lookups, leases, touches, pins, presence, payloads and same-host locates."""
        self.writes = StoreWrites(self._core)
        """The one write path (prepare, fill, reserve, commit, abort; put, stage), deletion and
        the expiry sweep."""
        self.prefetch = StorePrefetch(self._core)
        """Chain moves into the first tier ahead of their reads (``store.prefetch``)."""
        try:
            self.recovery.adopt_recovered()
        except BaseException:
            if self._core.behind is not None:  # its thread; the tiers stay the caller's
                self._core.behind.close()
            raise

    @property
    def tiers(self) -> list[Tier]:
        return list(self._core.tiers)

    @property
    def clock(self) -> Clock:
        return self._core.clock

    @property
    def forecast(self) -> Forecast | None:
        """The eviction policy's forecast settings; None under plain LRU."""
        return self._core.policy.forecast

    def tier_names(self) -> list[str]:
        return list(self._core.tier_index)

    def observe(self, observer: StoreObserver) -> None:
        """Add an observer (one the node builds after the store: miss attribution)."""
        with self._core.lock:
            self._core.observers.append(observer)
            if isinstance(observer, DropObserver):
                self._core.drop_observers.append(observer)

    def counters(self) -> Counters:
        """A snapshot of the event counters."""
        with self._core.lock:
            counters = replace(self._core.counters)
        if self._core.shared is not None:
            # damaged values the shared tier met while locating: never read, still corrupt
            counters.corrupt_reads += self._core.shared[1].corrupt_located()
        return counters

    def stats_tiers(self) -> list[TierStats]:
        """Per-tier figures only: cheap enough for every request."""
        rooms = [self._core.room_of(i) for i in range(len(self._core.tiers))]
        with self._core.lock:
            return [
                TierStats(t.name, t.capacity_bytes, t.used_bytes, n, t.durable, pinned, room)
                for t, n, pinned, room in zip(
                    self._core.tiers,
                    self._core.index.tier_blocks,
                    self._core.index.pinned_bytes,
                    rooms,
                    strict=True,
                )
            ]

    def namespace_usage(self) -> dict[bytes, NamespaceUsage]:
        """Blocks and payload bytes held per namespace root, for the dashboard and scrapes.

        The lock is held only to copy two columns of the held records; the counting runs
        outside, so a scrape does not stall the data path for it: figures of a moment, as
        any scrape's."""
        with self._core.lock:
            root_list, roots, nbytes = self._core.index.held_columns()
        numbers, inverse = np.unique(roots, return_inverse=True)
        blocks = np.bincount(inverse, minlength=len(numbers))
        sizes = np.bincount(inverse, weights=nbytes, minlength=len(numbers))
        return {
            root_list[number]: NamespaceUsage(count, int(size))
            for number, count, size in zip(
                numbers.tolist(), blocks.tolist(), sizes.tolist(), strict=True
            )
        }

    def stats(self) -> StoreStats:
        with self._core.lock:
            self._core.index.leases.reap(self._core.clock.now())
            return StoreStats(
                tiers=self.stats_tiers(),
                blocks=self._core.index.held_count(),
                pinned_blocks=self._core.index.pinned_count(),
                leases=len(self._core.index.leases),
                counters=replace(self._core.counters),
            )

    @property
    def write_behind(self) -> WriteBehind | None:
        """The queue of blocks on their way to the durable tier (None: none)."""
        return self._core.behind

    def close(self) -> None:
        if self.republisher is not None:
            self.republisher.close()
        if self._core.behind is not None:
            self._core.behind.close()  # what is queued is written first
        for tier in self._core.tiers:
            tier.close()

    @property
    def shared_memory_tier(self) -> SharedMemoryTier | None:
        """The tier same-host peers map, if the store has one."""
        return self._core.shm[1] if self._core.shm is not None else None

    @property
    def shared_memory_tier_name(self) -> str | None:
        """The name of that tier (a write prepared into it can be ``reserve``d)."""
        return self._core.tiers[self._core.shm[0]].name if self._core.shm is not None else None
