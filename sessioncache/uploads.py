"""Upload slots: the ids a two-phase store handed out, and to whom.

``POST /v1/store`` computes a prompt's chain server-side and answers with the ids still
missing; each of those may then be uploaded once by the same tenant, within ``ttl_s``. A
payload for an id that was not handed out to that caller is refused, so nobody can plant a
payload under an id they did not derive from their own tokens and namespace.

A slot outlives its first upload (marked ``used``) until it expires: a client whose answer was
lost (a timeout, a dropped connection) sends the same PUT again, and the node answers
``stored=false`` for the same bytes instead of refusing it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

from sessioncache.clock import Clock
from sessioncache.hashing import BlockHash
from sessioncache.store import Write


@dataclass(frozen=True, slots=True)
class UploadSlot:
    tenant: str
    block_hash: BlockHash
    write: Write
    """The prepared write of the plan that handed the slot out (its root, parents, TTL)."""
    index: int
    """The block's place in ``write``."""
    session_id: str | None
    expires_at: float
    used: bool = False
    """Uploaded once already: a repeat must carry the same bytes."""


class UploadSlots:
    """Bounded, expiring map of open upload slots (oldest dropped first when full)."""

    def __init__(self, clock: Clock, *, ttl_s: float = 600.0, max_slots: int = 1_000_000) -> None:
        self._clock = clock
        self._ttl = ttl_s
        self._max = max_slots
        self._lock = threading.Lock()
        self._slots: OrderedDict[tuple[str, BlockHash], UploadSlot] = OrderedDict()

    def open(
        self,
        tenant: str,
        block_hash: BlockHash,
        write: Write,
        index: int,
        *,
        session_id: str | None,
    ) -> None:
        slot = UploadSlot(
            tenant, block_hash, write, index, session_id, self._clock.now() + self._ttl
        )
        with self._lock:
            key = (tenant, block_hash)
            self._slots.pop(key, None)
            self._slots[key] = slot
            while len(self._slots) > self._max:
                self._slots.popitem(last=False)

    def peek(self, tenant: str, block_hash: BlockHash) -> UploadSlot | None:
        """The open slot for this caller and id, or None (unknown, expired, or used)."""
        with self._lock:
            self._reap()
            return self._slots.get((tenant, block_hash))

    def mark_used(self, tenant: str, block_hash: BlockHash) -> None:
        """The slot's block was uploaded; the slot stays open for retries until it expires."""
        with self._lock:
            slot = self._slots.get((tenant, block_hash))
            if slot is not None and not slot.used:
                self._slots[(tenant, block_hash)] = replace(slot, used=True)

    def close(self, tenant: str, block_hash: BlockHash) -> None:
        with self._lock:
            self._slots.pop((tenant, block_hash), None)

    def __len__(self) -> int:
        with self._lock:
            self._reap()
            return len(self._slots)

    def _reap(self) -> None:
        now = self._clock.now()
        while self._slots:
            key, slot = next(iter(self._slots.items()))
            if slot.expires_at > now:
                return
            del self._slots[key]
