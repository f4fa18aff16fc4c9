"""Start-up reconciliation of the catalog with the durable tiers.

The files are the truth for payloads, the catalog for what the files do not record (parents,
hit counts, TTLs). After a crash the two disagree by at most the catalog's last write-behind
batch, plus whatever was changed by hand:

* a file without a row (its row was still queued, or the catalog is new) is *adopted*: a row
  is inserted, after reading the payload back to verify its checksum (``verify=True``; the disk
  tier quarantines a file that fails, which is then counted as *quarantined*);
* a row without a file (the file was deleted or quarantined) is *dropped*.

Run it at start-up, after building the store (``reconcile(catalog, store)``) and before serving.

A fast restart skips both walks: ``CatalogRecoveredTier(..., from_catalog=True)``
over a tier opened without its scan (``DiskTier.open(..., scan=False)``) takes the catalog's
rows as the index (read in columnar batches, ``Catalog.iter_recovered_batches``, handed to the
tier with ``adopt_batch`` and to the store one by one or, ``recovered_batches()``, in bulk),
files unopened (each read verifies its file: a bad or missing one is a miss, quarantined, and
its row dropped), and ``BackgroundReconcile`` then walks the folders while the node serves,
adopting the files the catalog lacks (verified) with ``TieredStore.adopt_found``.

``CatalogRecoveredTier`` goes the other way: wrapped around a durable tier before the store is
built, it fills in what the tier's start-up scan cannot know (a block's last access, TTL and expiry;
its parent, for a tier whose files do not record it) from the catalog, so that the adopted
blocks keep their LRU order, their chains and the expiry they had (session-raised TTLs
included).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import islice
from typing import Any, Final

import torch

from sessioncache.catalog.repository import BlockRecord, Catalog
from sessioncache.hashing import BlockHash, payload_checksum
from sessioncache.store import DEFAULT_TTL_S, TieredStore
from sessioncache.tiers.base import (
    LazyStartTier,
    PutItem,
    RecoverableTier,
    RecoveredBatch,
    RecoveredBlock,
    Tier,
)
from sessioncache.tiers.payload import as_memoryview

log = logging.getLogger("sessioncache.catalog.reconcile")

_BATCH = 1000


@dataclass(frozen=True, slots=True)
class ReconcileReport:
    adopted: int
    """Files without a row that passed verification: a row was inserted."""
    quarantined: int
    """Files without a row that failed verification (quarantined by the tier)."""
    dropped_rows: int
    """Rows whose block the tier does not hold: deleted."""
    kept: int
    """Rows matching a file."""
    seconds: float


def checksum_of(data: torch.Tensor) -> bytes:
    """The catalog's ``checksum`` of a payload: its ``payload_checksum``, 8 bytes big-endian."""
    return payload_checksum(as_memoryview(data)).to_bytes(8, "big")


def reconcile(
    catalog: Catalog,
    target: TieredStore | Tier | Sequence[Tier],
    *,
    verify: bool = True,
    default_ttl_s: float = DEFAULT_TTL_S,
) -> ReconcileReport:
    """Make the catalog's block rows match the durable tiers of ``target`` (a store, a tier or
    a list of tiers); see the module docstring. Non-durable tiers are skipped.

    With a store, the rows of adopted blocks take the store's view of them (parent, TTL), a
    file failing verification is dropped from the store too, and the catalog learns which
    tiers are durable (``Catalog.bind_tiers``). ``default_ttl_s`` is the TTL given to rows of
    blocks the store does not know (a bare tier).
    """
    start = time.perf_counter()
    store = target if isinstance(target, TieredStore) else None
    if isinstance(target, TieredStore):
        tiers = target.tiers
        catalog.bind_tiers(tiers)
    elif isinstance(target, Tier):
        tiers = [target]
    else:
        tiers = list(target)
    catalog.flush()
    adopted = quarantined = dropped = kept = 0
    for tier in tiers:
        if not tier.durable:
            continue
        a, q, d, k = _reconcile_tier(catalog, tier, store, verify, default_ttl_s)
        adopted, quarantined, dropped, kept = adopted + a, quarantined + q, dropped + d, kept + k
        log.info(
            "catalog reconciled with tier %r: %d rows kept, %d files adopted, %d quarantined, "
            "%d rows dropped",
            tier.name,
            k,
            a,
            q,
            d,
        )
    report = ReconcileReport(adopted, quarantined, dropped, kept, time.perf_counter() - start)
    log.info(
        "catalog reconciled in %.3fs: adopted %d, quarantined %d, dropped %d rows",
        report.seconds,
        adopted,
        quarantined,
        dropped,
    )
    return report


def _reconcile_tier(
    catalog: Catalog,
    tier: Tier,
    store: TieredStore | None,
    verify: bool,
    default_ttl_s: float,
) -> tuple[int, int, int, int]:
    rows = set(catalog.iter_block_ids(tier.name))
    held = set(tier.keys())
    recovered: dict[BlockHash, RecoveredBlock] = {}
    if isinstance(tier, RecoverableTier):
        recovered = {b.block_hash: b for b in tier.recovered() if b.block_hash not in rows}
    adopted = quarantined = 0
    batch: list[BlockRecord] = []
    for block_hash in sorted(held - rows):
        meta = store.reads.meta(block_hash) if store is not None else None
        found = recovered.get(block_hash)
        if meta is None and found is None:
            continue  # stored after the scan without our observer: nothing to describe it
        checksum = None
        if verify:
            data = tier.get(block_hash)
            if data is None:
                quarantined += 1
                if store is not None and store.reads.where(block_hash) == [tier.name]:
                    store.writes.delete([block_hash])
                continue
            checksum = checksum_of(data)
        if meta is not None:
            record = BlockRecord.from_meta(meta, tier.name, checksum)
        else:
            assert found is not None
            record = BlockRecord(
                block_id=block_hash,
                tier=tier.name,
                namespace_root=found.namespace_root,
                parent=found.parent,
                nbytes=found.nbytes,
                created=found.mtime,
                last_access=found.mtime,
                expires_at=found.mtime + default_ttl_s,
                ttl_s=default_ttl_s,
                checksum=checksum,
            )
        batch.append(record)
        if len(batch) >= _BATCH:
            adopted += catalog.upsert_blocks(batch)
            batch.clear()
    adopted += catalog.upsert_blocks(batch)
    gone = rows - held
    dropped = catalog.delete_blocks(tier.name, gone) if gone else 0
    return adopted, quarantined, dropped, len(rows & held)


class CatalogRecoveredTier:
    """A durable tier whose ``recovered()`` takes each block's parent, last access, TTL and
    expiry from the catalog's rows (see the module docstring); everything else goes to the
    tier as is.

    Build the store over it: ``TieredStore([..., CatalogRecoveredTier(disk, catalog)])``.
    """

    def __init__(self, tier: Tier, catalog: Catalog, *, from_catalog: bool = False) -> None:
        if not isinstance(tier, RecoverableTier):
            raise TypeError(f"tier {tier.name!r} cannot say what it recovered")
        if from_catalog and not isinstance(tier, LazyStartTier):
            raise TypeError(f"tier {tier.name!r} cannot take its index from the catalog")
        self._tier = tier
        self._catalog = catalog
        self._from_catalog = from_catalog
        # The tier's fixed facts, as the Tier protocol reads them.
        self.name: Final = tier.name
        self.capacity_bytes: Final = tier.capacity_bytes
        self.durable: Final = tier.durable

    @property
    def inner(self) -> Tier:
        return self._tier

    def recovered(self) -> Iterator[RecoveredBlock]:
        assert isinstance(self._tier, RecoverableTier)
        self._catalog.flush()
        if self._from_catalog:
            for batch in self.recovered_batches():
                yield from batch.blocks()
            return
        found = iter(self._tier.recovered())
        while chunk := list(islice(found, _BATCH)):
            rows = self._catalog.lookup_blocks(self._tier.name, [b.block_hash for b in chunk])
            for block in chunk:
                row = rows.get(block.block_hash)
                if row is None or row.namespace_root != block.namespace_root:
                    yield block
                    continue
                yield replace(
                    block,
                    parent=row.parent if row.parent is not None else block.parent,
                    mtime=max(block.mtime, row.last_access),
                    ttl_s=row.ttl_s,
                    expires_at=row.expires_at,
                )

    def recovered_batches(self) -> Iterator[RecoveredBatch]:
        """``recovered()`` column by column, for a bulk adoption. From the catalog: its rows
        as read, each batch handed to the tier unopened (``adopt_batch``) before it is
        yielded; otherwise ``recovered()``'s blocks in batches."""
        if not self._from_catalog:
            found = iter(self.recovered())
            while chunk := list(islice(found, _BATCH)):
                yield RecoveredBatch.of(chunk)
            return
        assert isinstance(self._tier, LazyStartTier)
        self._catalog.flush()
        for batch in self._catalog.iter_recovered_batches(self.name):
            self._tier.adopt_batch(batch)
            yield batch

    # -- the Tier protocol, delegated -----------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._tier.used_bytes

    def fits(self, nbytes: int) -> bool:
        return self._tier.fits(nbytes)

    def contains(self, block_hash: BlockHash) -> bool:
        return self._tier.contains(block_hash)

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        return self._tier.get(block_hash)

    def put(self, item: PutItem) -> None:
        self._tier.put(item)

    def delete(self, block_hash: BlockHash) -> int:
        return self._tier.delete(block_hash)

    def keys(self) -> list[BlockHash]:
        return self._tier.keys()

    def close(self) -> None:
        self._tier.close()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._tier, name)


def adopt_unlisted(store: TieredStore, *, verify: bool = True) -> ReconcileReport:
    """The background half of a fast restart: each durable tier that started from the
    catalog walks its folders for the files the catalog lacks (a crash lost their rows'
    write-behind batch), which are verified (``verify``: read back; a bad one is
    quarantined by the tier) and indexed by the store, whose observers write their rows;
    the rows whose files the walk did not find are dropped (as their first read would)."""
    start = time.perf_counter()
    adopted = quarantined = dropped = 0
    for tier in store.tiers:
        inner = tier.inner if isinstance(tier, CatalogRecoveredTier) else tier
        if not tier.durable or not isinstance(inner, LazyStartTier):
            continue
        found = inner.scan_unindexed()
        good = []
        for block in found:
            if verify and tier.get(block.block_hash) is None:
                quarantined += 1
                continue
            good.append(block)
        adopted += store.recovery.adopt_found(tier.name, good)
        dropped += store.recovery.forget_copies(tier.name, inner.missing())
    report = ReconcileReport(adopted, quarantined, dropped, 0, time.perf_counter() - start)
    log.info(
        "background pass: %d files the catalog lacked adopted, %d quarantined, "
        "%d rows without a file dropped, %.3fs",
        adopted,
        quarantined,
        dropped,
        report.seconds,
    )
    return report


class BackgroundReconcile:
    """``adopt_unlisted`` on a daemon thread, started once; ``problem()`` says it is still
    running (``/readyz`` shows it), ``wait()`` joins it."""

    def __init__(self, store: TieredStore, *, verify: bool = True) -> None:
        self._store = store
        self._verify = verify
        self._done = threading.Event()
        self._started = 0.0
        self.report: ReconcileReport | None = None
        self.error: str | None = None
        self._thread = threading.Thread(
            target=self._run, name="sessioncache-reconcile", daemon=True
        )

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        try:
            self.report = adopt_unlisted(self._store, verify=self._verify)
        except Exception as exc:  # a failed pass leaves files unadopted, not the node down
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("background pass failed")
        finally:
            self._done.set()

    def running(self) -> bool:
        return self._thread.is_alive() and not self._done.is_set()

    def problem(self) -> str | None:
        if self.running():
            return (
                "reconciling: indexing disk files the catalog lacks "
                f"({time.monotonic() - self._started:.1f}s so far); lookups read those they ask for"
            )
        if self.error is not None:
            return f"reconciling failed: {self.error}"
        return None

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def close(self, grace_s: float = 60.0) -> None:
        """Wait for the pass (up to ``grace_s``): its rows go to the catalog, closed next."""
        if self._started and not self.wait(grace_s):
            log.warning("background pass still running after %.0fs: closing anyway", grace_s)
