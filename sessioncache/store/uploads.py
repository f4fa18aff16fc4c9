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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from sessioncache.clock import Clock
from sessioncache.hashing import BlockHash
from sessioncache.quotas import refuse
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
    """The open upload slots of every tenant, expiring, at most ``limit(tenant)`` per tenant.
    A store that would take a tenant past its bound first closes that tenant's own used slots
    (oldest first: their uploads are done, only a retry would need them), then is refused
    whole; it never touches another tenant's slots."""

    def __init__(
        self, clock: Clock, *, ttl_s: float = 600.0, limit: Callable[[str], int] | None = None
    ) -> None:
        self._clock = clock
        self._ttl = ttl_s
        self._limit = limit or (lambda tenant: 1_000_000)
        self._lock = threading.Lock()
        self._slots: dict[str, OrderedDict[BlockHash, UploadSlot]] = {}

    def open_many(
        self,
        tenant: str,
        hashes: Sequence[BlockHash],
        write: Write,
        *,
        session_id: str | None,
    ) -> None:
        """A slot for each of ``hashes`` (block ``i`` of ``write``); ``QuotaExceeded`` (and no
        slot opened) when the tenant would hold more than its bound."""
        expires_at = self._clock.now() + self._ttl
        limit = self._limit(tenant)
        with self._lock:
            if tenant in self._slots:
                self._reap(tenant, self._slots[tenant])
            mine = self._slots.setdefault(tenant, OrderedDict())
            fresh = [h for h in hashes if h not in mine]
            if len(mine) + len(fresh) > limit:
                for h in [h for h, slot in mine.items() if slot.used]:
                    if len(mine) + len(fresh) <= limit:
                        break
                    del mine[h]
            if len(mine) + len(fresh) > limit:
                held = len(mine)
                if not mine:
                    del self._slots[tenant]
                raise refuse(
                    tenant,
                    "upload_slots",
                    held,
                    limit,
                    f"upload slots open, and this store asks {len(fresh)} more",
                )
            for index, block_hash in enumerate(hashes):
                mine.pop(block_hash, None)
                mine[block_hash] = UploadSlot(
                    tenant, block_hash, write, index, session_id, expires_at
                )

    def peek(self, tenant: str, block_hash: BlockHash) -> UploadSlot | None:
        """The open slot for this caller and id, or None (unknown or expired)."""
        with self._lock:
            mine = self._slots.get(tenant)
            if mine is None:
                return None
            self._reap(tenant, mine)
            return mine.get(block_hash)

    def mark_used(self, tenant: str, block_hash: BlockHash) -> None:
        """The slot's block was uploaded; the slot stays open for retries until it expires."""
        with self._lock:
            mine = self._slots.get(tenant)
            slot = None if mine is None else mine.get(block_hash)
            if mine is not None and slot is not None and not slot.used:
                mine[block_hash] = replace(slot, used=True)

    def close(self, tenant: str, block_hash: BlockHash) -> None:
        with self._lock:
            mine = self._slots.get(tenant)
            if mine is not None:
                mine.pop(block_hash, None)

    def per_tenant(self) -> dict[str, int]:
        """Open slots per tenant."""
        with self._lock:
            for tenant, mine in list(self._slots.items()):
                self._reap(tenant, mine)
            return {tenant: len(mine) for tenant, mine in self._slots.items()}

    def __len__(self) -> int:
        return sum(self.per_tenant().values())

    def _reap(self, tenant: str, mine: OrderedDict[BlockHash, UploadSlot]) -> None:
        """Drop the tenant's expired slots (in opening order: the oldest expire first)."""
        now = self._clock.now()
        while mine:
            block_hash, slot = next(iter(mine.items()))
            if slot.expires_at > now:
                break
            del mine[block_hash]
        if not mine:
            self._slots.pop(tenant, None)
