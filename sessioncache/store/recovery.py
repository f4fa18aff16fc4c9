"""What durable tiers found: indexed on start, and adopted or forgotten while the store serves."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator, Sequence
from itertools import islice

from sessioncache.hashing import BlockHash
from sessioncache.store.core import StoreCore, StorePart
from sessioncache.tiers.base import (
    BatchRecoverableTier,
    LazyStartTier,
    RecoverableTier,
    RecoveredBatch,
    RecoveredBlock,
)

log = logging.getLogger("sessioncache.store")
_ADOPT_CHUNK = 65536  # blocks found on start, indexed a batch at a time


class StoreRecovery(StorePart):
    """What durable tiers found (``TieredStore.recovery``): indexed on start, adopted or
    forgotten while the store serves."""

    def __init__(self, core: StoreCore) -> None:
        super().__init__(core)
        # the durable tiers that may start unscanned, found once (a protocol check per
        # lookup would cost more than the lookup's own work)
        self._lazy: list[tuple[str, LazyStartTier]] = [
            (t.name, t) for t in core.tiers if t.durable and isinstance(t, LazyStartTier)
        ]

    def adopt_found(self, tier_name: str, found: Sequence[RecoveredBlock]) -> int:
        """Index blocks a durable tier found while the store serves (the background pass of
        a fast restart: files the catalog lacked), as copies added now: observers hear of
        them (the catalog writes their rows). Returns how many were new to the store."""
        index = self._core.tier_by_name(tier_name)
        adopted = 0
        with self._core.lock:
            now = self._core.clock.now()
            for block in found:
                meta = self._core.index.get(block.block_hash)
                if meta is None:
                    meta = self._core.index.new_record(
                        block.block_hash,
                        parent=block.parent,
                        namespace_root=block.namespace_root,
                        nbytes=block.nbytes,
                        ttl_s=block.ttl_s if block.ttl_s is not None else self._core.default_ttl,
                        created=block.mtime,
                        last_access=min(block.mtime, now),
                        expires_at=block.expires_at,
                    )
                elif meta.mask >> index & 1:
                    continue
                self._core.payload_sizes.setdefault(block.namespace_root, block.nbytes)
                self._core.add_to_tier(meta, index)
                adopted += 1
        return adopted

    def adopt_unscanned(self, hashes: Sequence[BlockHash]) -> int:
        """Index the files of ``hashes`` that a durable tier still walking its folders (a
        fast restart's background pass) holds and has not indexed yet, as far as they run:
        what a lookup asks for is served before the walk reaches it. How many were new."""
        adopted = 0
        for name, tier in self._lazy:
            if tier.unscanned:
                found = tier.find_unindexed(hashes)
                if found:
                    adopted += self.adopt_found(name, found)
        return adopted

    def scanning(self) -> bool:
        """Whether a durable tier is still walking its folders for files it has not indexed
        (``adopt_unscanned`` may then find some)."""
        return any(tier.unscanned for _, tier in self._lazy)

    def forget_copies(self, tier_name: str, hashes: Sequence[BlockHash]) -> int:
        """Forget the copies in ``tier_name`` of blocks that tier no longer holds (their files
        are gone), unless pinned (a read under way finds out itself); observers hear of it.
        Returns how many were forgotten."""
        index = self._core.tier_by_name(tier_name)
        forgotten = 0
        with self._core.lock:
            for block_hash in hashes:
                meta = self._core.index.get(block_hash)
                if meta is None or meta.ref_cnt or not meta.mask >> index & 1:
                    continue
                self._core.drop_from_tier(meta, index, delete=False)
                forgotten += 1
        return forgotten

    def adopt_recovered(self) -> None:
        """Index what durable tiers found on start (their files outlive the process).

        The cyclic garbage collector is held off meanwhile: a bulk load of long-lived
        records would otherwise trigger full collections over a growing heap (quadratic)."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._adopt_all()
        finally:
            if collecting:
                gc.enable()

    def _adopt_all(self) -> None:
        now = self._core.clock.now()
        for index, tier in enumerate(self._core.tiers):
            if not isinstance(tier, RecoverableTier):
                continue
            adopted = 0
            for batch in _batches(tier):
                self._core.index.adoption.recovered(batch, index, now, self._core.default_ttl)
                sizes = self._core.payload_sizes
                for root, nbytes in zip(batch.namespace_roots, batch.nbytes.tolist(), strict=True):
                    if root not in sizes:
                        sizes[root] = nbytes
                adopted += len(batch)
            if adopted:
                log.info("adopted %d blocks found in tier %s", adopted, tier.name)
        self._core.index.adoption.relink()  # chain links need every record in place first


def _batches(tier: RecoverableTier) -> Iterator[RecoveredBatch]:
    """What ``tier`` found on start, in batches: its own when it has them (a fast restart's
    catalog rows), else its blocks gathered."""
    if isinstance(tier, BatchRecoverableTier):
        yield from tier.recovered_batches()
        return
    found = iter(tier.recovered())
    while chunk := list(islice(found, _ADOPT_CHUNK)):
        yield RecoveredBatch.of(chunk)
