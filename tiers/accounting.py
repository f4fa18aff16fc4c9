"""A tier that accounts payload sizes and stores no bytes: for simulation only.

``AccountingTier`` keeps a map from id to payload size and enforces its byte budget exactly like
a real tier (``fits``, ``TierFull``, ``PayloadSizeError``, ``used_bytes``), so the
``TieredStore``, its eviction policy and the session manager behave as they would over real
memory, while a replay of millions of blocks allocates nothing per block (see
``sessioncache.replay``).

The payload's bytes are not kept: ``get`` returns a 1-D ``torch.uint8`` tensor of the right
length that reads as zeros and allocates nothing (a single byte expanded with stride 0).
Its length is what matters: the store copies a ``get`` result into another tier when it demotes
or promotes a block, and that copy must account the same size. Never put one of these tiers
under a real engine.
"""

from __future__ import annotations

import threading
from typing import Final

import torch

from sessioncache.errors import TierFull
from sessioncache.hashing import BlockHash
from sessioncache.tiers.base import PutItem
from sessioncache.tiers.payload import checked_nbytes

_ZERO = torch.zeros(1, dtype=torch.uint8)
_VIEWS: dict[int, torch.Tensor] = {}


def zero_payload(nbytes: int) -> torch.Tensor:
    """A 1-D uint8 tensor of length ``nbytes`` that allocates nothing (one byte, stride 0).

    One tensor per size is shared by every caller: its length is all that means anything (it
    reads as zeros unless someone writes through it, which a simulation has no reason to do).
    """
    view = _VIEWS.get(nbytes)
    if view is None:
        view = _VIEWS[nbytes] = _ZERO.expand(nbytes)
    return view


class AccountingTier:
    """A byte-bounded map from id to payload size (see the module docstring)."""

    def __init__(self, name: str, capacity_bytes: int, *, durable: bool = False) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.name: Final = name
        self.capacity_bytes: Final = capacity_bytes
        self.durable: Final = durable
        self._lock = threading.Lock()
        self._sizes: dict[BlockHash, int] = {}
        self._used = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._sizes)

    def fits(self, nbytes: int) -> bool:
        return self._used + nbytes <= self.capacity_bytes

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._sizes

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        nbytes = self._sizes.get(block_hash)
        return None if nbytes is None else zero_payload(nbytes)

    def put(self, item: PutItem) -> None:
        block_hash, payload = item.block_hash, item.payload
        nbytes = checked_nbytes(payload, self.name, self.capacity_bytes)
        with self._lock:
            if block_hash in self._sizes:
                return
            if self._used + nbytes > self.capacity_bytes:
                raise TierFull(f"{self.name}: no room for {nbytes} bytes")
            self._sizes[block_hash] = nbytes
            self._used += nbytes

    def delete(self, block_hash: BlockHash) -> int:
        with self._lock:
            nbytes = self._sizes.pop(block_hash, 0)
            self._used -= nbytes
            return nbytes

    def keys(self) -> list[BlockHash]:
        with self._lock:
            return list(self._sizes)

    def close(self) -> None:
        with self._lock:
            self._sizes.clear()
            self._used = 0
