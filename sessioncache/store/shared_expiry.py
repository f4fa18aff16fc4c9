"""Keeps the shared tier's key expiries in step with the store's sliding TTLs.

A lookup on any node slides the TTL of the blocks it touches; blocks held in the shared tier
must then live longer in Redis too, or another node would miss them. Touches are queued from
the store's observer callbacks (never blocking, coalesced per block) and a small thread sends
them as one pipelined ``PEXPIREAT ... GT`` batch per period.
"""

from __future__ import annotations

import logging
import threading

from sessioncache.background import BackgroundLoop
from sessioncache.hashing import BlockHash
from sessioncache.store.blocks import BlockMeta
from sessioncache.store.events import Touched
from sessioncache.tiers.base import SharedTier

log = logging.getLogger("sessioncache.store.shared_expiry")


class SharedExpiryRefresher:
    """A ``StoreObserver`` that raises shared-tier expiries; ``start``/``stop`` its thread."""

    def __init__(
        self,
        tier: SharedTier,
        tier_name: str,
        *,
        interval_s: float = 1.0,
        max_pending: int = 1_000_000,
    ) -> None:
        self._tier = tier
        self._name = tier_name
        self._interval = interval_s
        self._max = max_pending
        self._pending: dict[BlockHash, float] = {}
        self._lock = threading.Lock()
        self._loop = BackgroundLoop("sessioncache-shared-expiry", self.flush, interval_s)
        self._shared_index: int | None = None

    def bind(self, tier_index: int) -> None:
        """The shared tier's index in the store (``BlockMeta.tiers`` holds indices)."""
        self._shared_index = tier_index

    def block_added(self, meta: BlockMeta, tier: str, durable: bool) -> None:
        pass

    def block_removed(self, block_hash: BlockHash, tier: str, durable: bool) -> None:
        pass

    def blocks_touched(self, touched: Touched) -> None:
        index = self._shared_index
        if index is None:
            return
        bit = 1 << index
        with self._lock:
            pending = self._pending
            for h, mask, expires in zip(
                touched.hashes, touched.masks, touched.expires_at, strict=False
            ):
                if mask & bit and len(pending) < self._max:
                    pending[h] = expires

    def flush(self) -> int:
        with self._lock:
            batch, self._pending = self._pending, {}
        if batch:
            try:
                self._tier.set_expiry_many(list(batch.items()))
            except Exception:  # the tier degrades on its own; expiries are best effort
                log.debug("shared expiry refresh failed", exc_info=True)
        return len(batch)

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()
        self.flush()
