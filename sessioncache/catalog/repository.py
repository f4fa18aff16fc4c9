"""The catalog: a ``StoreObserver`` and ``SessionRepository`` over SQL, written behind.

Hot path. The store calls ``block_added``/``block_removed``/``blocks_touched`` with its lock
held, and ``SessionManager`` calls ``save_session`` on every request: these only record the
change in small in-memory maps under a tiny lock, never touching SQL. The maps coalesce: the
latest state wins per (block, tier), per block for touches (a million lookups of one block
become one ``UPDATE``), per session for saves, and counters add up per (name, bucket).

A flusher thread (``start()``; the constructor starts nothing) writes everything pending in one
transaction every ``flush_interval_s``, or sooner once ``max_pending`` changes are queued;
``flush()`` does the same synchronously and ``close()`` flushes and stops. A failed flush puts
its changes back (older than anything queued since) and is retried with back-off.

What a crash loses is the pending batch only: block rows lagging their files are re-adopted by
``reconcile`` on the next start, so a block is never lost, only its last access times, hit
counts and counters of that batch. ``create_session`` and ``delete_session`` are synchronous
transactions: durable when they return.

Durable tiers (``durable=True`` in the observer calls) get one row per (block, tier); blocks in
other tiers only bump usage counters (``blocks_added:<tier>``, ``bytes_added:<tier>``,
``blocks_removed:<tier>``, ``blocks_touched``), as do callers of ``record_usage`` (for instance
hit and miss tokens).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import (
    Connection,
    Engine,
    Executable,
    func,
    select,
)
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError

from sessioncache.background import BackgroundLoop
from sessioncache.catalog import bulk
from sessioncache.catalog.db import SQLITE_BUSY_TIMEOUT_S, make_engine
from sessioncache.catalog.health import (
    CatalogHealth,
    CatalogWriter,
    answered,
    unavailable_reason,
    write_nothing,
)
from sessioncache.catalog.models import (
    blocks_table,
    namespaces_table,
    usage_table,
)
from sessioncache.catalog.retry import retried_on_disconnect
from sessioncache.catalog.session_rows import SessionRows
from sessioncache.catalog.statements import Statements
from sessioncache.clock import Clock, SystemClock
from sessioncache.errors import CatalogError, CatalogNotMigrated, CatalogUnavailable
from sessioncache.hashing import BlockHash
from sessioncache.sessions.manager import Session, SessionKey
from sessioncache.store.blocks import BlockMeta
from sessioncache.store.events import Touched
from sessioncache.tiers.base import RecoveredBatch, RecoveredBlock, Tier

if TYPE_CHECKING:
    from sessioncache.sessions.manager import SessionRepository
    from sessioncache.store.events import StoreObserver

log = logging.getLogger("sessioncache.catalog")

DEFAULT_FLUSH_INTERVAL_S = 0.2
DEFAULT_MAX_PENDING = 10_000
DEFAULT_USAGE_BUCKET_S = 3600.0
MAX_RETRY_DELAY_S = 5.0
_CHUNK = 5000

_Touch = tuple[float, float, int, int, float]
"""(last_access, expires_at, hit_count, pin_count, ttl_s) of a block at its latest event."""


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """One row of ``blocks``: a block held in one durable tier."""

    block_id: BlockHash
    tier: str
    namespace_root: bytes
    parent: BlockHash | None
    nbytes: int
    created: float
    last_access: float
    expires_at: float
    ttl_s: float
    hit_count: int = 0
    pin_count: int = 0
    checksum: bytes | None = None

    @classmethod
    def from_meta(
        cls,
        meta: BlockMeta,
        tier: str,
        checksum: bytes | None = None,
        *,
        pins: int | None = None,
    ) -> BlockRecord:
        return cls(
            block_id=meta.block_hash,
            tier=tier,
            namespace_root=meta.namespace_root,
            parent=meta.parent,
            nbytes=meta.nbytes,
            created=meta.created,
            last_access=meta.last_access,
            expires_at=meta.expires_at,
            ttl_s=meta.ttl_s,
            hit_count=meta.hit_count,
            pin_count=meta.ref_cnt if pins is None else pins,
            checksum=checksum,
        )


@dataclass(frozen=True, slots=True)
class UsageSample:
    """A counter's total over the bucket starting at ``bucket`` (epoch seconds)."""

    name: str
    bucket: float
    value: int


@dataclass(frozen=True, slots=True)
class CatalogStats:
    pending: int
    flushes: int
    rows_written: int
    errors: int
    last_error: str | None


@dataclass(slots=True)
class _Batch:
    blocks: dict[tuple[bytes, str], BlockRecord | None] = field(default_factory=dict)
    touches: dict[bytes, _Touch] = field(default_factory=dict)
    sessions: dict[SessionKey, Session] = field(default_factory=dict)
    usage: dict[tuple[str, float], int] = field(default_factory=dict)
    namespaces: dict[bytes, dict[str, Any]] = field(default_factory=dict)
    """Namespace rows registered while the catalog was unavailable (``register_namespace``)."""

    def __len__(self) -> int:
        return (
            len(self.blocks)
            + len(self.touches)
            + len(self.sessions)
            + len(self.usage)
            + len(self.namespaces)
        )


class Catalog:
    """Block, session and usage rows in SQL (see the module docstring).

    Build one with ``Catalog.open(url)`` (which owns its engine) or ``Catalog(engine)``.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        max_pending: int = DEFAULT_MAX_PENDING,
        usage_bucket_s: float = DEFAULT_USAGE_BUCKET_S,
        clock: Clock | None = None,
        owns_engine: bool = False,
        wait_s: float = SQLITE_BUSY_TIMEOUT_S,
    ) -> None:
        if not flush_interval_s > 0:
            raise CatalogError("flush_interval_s must be positive")
        if not usage_bucket_s > 0:
            raise CatalogError("usage_bucket_s must be positive")
        if engine.dialect.name not in ("sqlite", "postgresql"):
            raise CatalogError(f"unsupported database {engine.dialect.name!r}")
        self.engine: Final = engine
        self.flush_interval_s: Final = float(flush_interval_s)
        self._owns_engine = owns_engine
        self._max_pending = max(1, max_pending)
        self._bucket_s = float(usage_bucket_s)
        self._clock: Clock = clock or SystemClock()
        self._qlock = threading.Lock()  # guards the pending maps only: held for dict ops
        self.health: Final = CatalogHealth(label(engine.url), wait_s=wait_s)
        """Whether the catalog can be used now (``/readyz``; see ``catalog/health.py``)."""
        self._writer = CatalogWriter(engine, self.health)  # one SQL writer, batches in order
        self._state_lock = threading.Lock()
        self._pending = _Batch()
        self._durable_indices: frozenset[int] | None = None
        self._tier_counters: dict[str, tuple[str, str, str]] = {}
        self._flusher = BackgroundLoop(
            "sessioncache-catalog-flusher",
            self._flush_behind,
            flush_interval_s,
            max_backoff_s=MAX_RETRY_DELAY_S,
        )
        self._closed = False
        self._flushes = 0
        self._rows_written = 0
        self._errors = 0
        self._last_error: str | None = None
        self._stmts = Statements(engine.dialect.name)
        self.sessions: Final = SessionRows(self)
        """The session rows (``SessionRepository``): opens and closes durable on return,
        saves written behind with the block rows."""

    @classmethod
    def open(
        cls,
        url: str | URL,
        *,
        schema: str | None = None,
        migrate: bool = False,
        wait_s: float = SQLITE_BUSY_TIMEOUT_S,
        **kwargs: Any,
    ) -> Catalog:
        """A catalog on a new engine for ``url``; ``migrate`` runs the migrations first,
        otherwise the database must already be at the newest revision. A catalog that cannot
        be opened or written is a ``CatalogError`` naming it. ``wait_s``: how long a call
        waits for the database (``make_engine``) or for the writer."""
        from sessioncache.catalog import migrate as migrations

        engine = make_engine(url, schema=schema, wait_s=wait_s)
        try:
            try:
                if migrate:
                    migrations.upgrade(engine, schema=schema)
                else:
                    at, head = migrations.current(engine, schema=schema), migrations.head()
                    if at != head:
                        raise CatalogNotMigrated(
                            f"the catalog is at revision {at}, not {head}: "
                            "run `sessioncache db upgrade`"
                        )
            except SQLAlchemyError as exc:
                raise CatalogError(
                    f"cannot open the catalog {label(engine.url)}: {_reason(exc)}"
                ) from None
            try:
                write_nothing(engine)
            except SQLAlchemyError as exc:
                raise CatalogError(
                    f"the catalog {label(engine.url)} cannot be written: {_reason(exc)}"
                ) from None
            return cls(engine, owns_engine=True, wait_s=wait_s, **kwargs)
        except BaseException:
            engine.dispose()
            raise

    def bind_tiers(self, tiers: Sequence[Tier]) -> None:
        """Tell the catalog the store's tiers (fastest first), so that touches of blocks held
        in no durable tier are not queued (optional; ``reconcile`` calls it)."""
        self._durable_indices = frozenset(i for i, t in enumerate(tiers) if t.durable)

    # -- StoreObserver (store lock held: queue only) ------------------------------------

    def block_added(self, meta: BlockMeta, tier: str, durable: bool) -> None:
        added, nbytes, _removed = self._counter_names(tier)
        bucket = self._bucket(self._clock.now())
        with self._qlock:
            pending = self._pending
            if durable:
                # The store holds one in-flight pin on a block while it places it: count the
                # others, as touches do (they are reported before the operation's own pin).
                record = BlockRecord.from_meta(meta, tier, pins=max(0, meta.ref_cnt - 1))
                pending.blocks[(meta.block_hash, tier)] = record
                if meta.block_hash in pending.touches:  # older than this: must not win
                    pending.touches[meta.block_hash] = (
                        meta.last_access,
                        meta.expires_at,
                        meta.hit_count,
                        record.pin_count,
                        meta.ttl_s,
                    )
            usage = pending.usage
            usage[(added, bucket)] = usage.get((added, bucket), 0) + 1
            usage[(nbytes, bucket)] = usage.get((nbytes, bucket), 0) + meta.nbytes
            size = len(pending.blocks) + len(pending.touches)
        if size >= self._max_pending:
            self._flusher.wake()

    def block_removed(self, block_hash: BlockHash, tier: str, durable: bool) -> None:
        removed = self._counter_names(tier)[2]
        bucket = self._bucket(self._clock.now())
        with self._qlock:
            pending = self._pending
            if durable:
                pending.blocks[(block_hash, tier)] = None
            pending.usage[(removed, bucket)] = pending.usage.get((removed, bucket), 0) + 1
            size = len(pending.blocks) + len(pending.touches)
        if size >= self._max_pending:
            self._flusher.wake()

    def blocks_touched(self, touched: Touched) -> None:
        durable = self._durable_indices
        # a block counts when a durable tier holds it (all of them before ``bind``)
        wanted = -1 if durable is None else sum(1 << i for i in durable)
        key = ("blocks_touched", self._bucket(self._clock.now()))
        with self._qlock:
            touches = self._pending.touches
            for h, mask, last, expires, hits, ref, ttl in zip(
                touched.hashes,
                touched.masks,
                touched.last_access,
                touched.expires_at,
                touched.hit_count,
                touched.ref_cnt,
                touched.ttl_s,
                strict=False,
            ):
                if mask & wanted:
                    touches[h] = (last, expires, hits, ref, ttl)
            usage = self._pending.usage
            usage[key] = usage.get(key, 0) + len(touched)
            size = len(self._pending.blocks) + len(touches)
        if size >= self._max_pending:
            self._flusher.wake()

    # -- usage counters -----------------------------------------------------------------

    def record_usage(self, name: str, amount: int = 1, *, at: float | None = None) -> None:
        """Add ``amount`` to counter ``name`` in the bucket of ``at`` (default now); written
        behind like the rest."""
        key = (name, self._bucket(self._clock.now() if at is None else at))
        with self._qlock:
            usage = self._pending.usage
            usage[key] = usage.get(key, 0) + int(amount)

    @answered
    @retried_on_disconnect
    def usage(
        self,
        since: float,
        until: float | None = None,
        names: Sequence[str] | None = None,
    ) -> list[UsageSample]:
        """Counters of the buckets starting in ``[bucket of since, until)``, oldest first
        (flushes pending changes first)."""
        self.flush()
        t = usage_table
        query = select(t.c.name, t.c.bucket, t.c.value).where(t.c.bucket >= self._bucket(since))
        if until is not None:
            query = query.where(t.c.bucket < until)
        if names is not None:
            query = query.where(t.c.name.in_(list(names)))
        with self.engine.connect() as conn:
            rows = conn.execute(query.order_by(t.c.bucket, t.c.name)).all()
        return [UsageSample(r.name, float(r.bucket), int(r.value)) for r in rows]

    # -- block rows (synchronous: reconciliation, tools, tests) -------------------------

    @answered
    @retried_on_disconnect
    def block_records(self, tier: str | None = None) -> list[BlockRecord]:
        """The stored block rows (of one tier), as written so far (no flush)."""
        t = blocks_table
        query = select(t)
        if tier is not None:
            query = query.where(t.c.tier == tier)
        with self.engine.connect() as conn:
            rows = conn.execute(query.order_by(t.c.tier, t.c.block_id)).all()
        return [_record_of(r) for r in rows]

    def iter_recovered(self, tier: str) -> Iterator[RecoveredBlock]:
        """A tier's rows as the blocks a restart indexes, streamed (no flush): the index of a
        fast restart, so only the columns it needs, one object per namespace root, and per
        TTL and size in a batch."""
        for batch in self.iter_recovered_batches(tier):
            yield from batch.blocks()

    def iter_recovered_batches(
        self, tier: str, batch_rows: int = bulk.BATCH_ROWS
    ) -> Iterator[RecoveredBatch]:
        """``iter_recovered`` column by column, up to ``batch_rows`` rows a batch, read on the
        driver's cursor (see ``catalog/bulk.py``)."""
        return bulk.read_recovered_prefetched(self.engine, tier, batch_rows)

    def iter_block_ids(self, tier: str) -> Iterator[BlockHash]:
        """The ids of a tier's rows, streamed (no flush)."""
        t = blocks_table
        with self.engine.connect() as conn:
            result = conn.execution_options(yield_per=_CHUNK).execute(
                select(t.c.block_id).where(t.c.tier == tier)
            )
            for (block_id,) in result:
                yield BlockHash(bytes(block_id))

    @answered
    @retried_on_disconnect
    def lookup_blocks(
        self, tier: str, block_ids: Sequence[BlockHash]
    ) -> dict[BlockHash, BlockRecord]:
        """The rows of ``block_ids`` in ``tier`` that exist (no flush)."""
        t = blocks_table
        found: dict[BlockHash, BlockRecord] = {}
        with self.engine.connect() as conn:
            for start in range(0, len(block_ids), _CHUNK):
                chunk = [bytes(b) for b in block_ids[start : start + _CHUNK]]
                query = select(t).where(t.c.tier == tier, t.c.block_id.in_(chunk))
                for row in conn.execute(query):
                    record = _record_of(row)
                    found[record.block_id] = record
        return found

    @answered
    @retried_on_disconnect
    def count_blocks(self, tier: str | None = None) -> int:
        query = select(func.count()).select_from(blocks_table)
        if tier is not None:
            query = query.where(blocks_table.c.tier == tier)
        with self.engine.connect() as conn:
            return int(conn.execute(query).scalar_one())

    def upsert_blocks(self, records: Iterable[BlockRecord]) -> int:
        """Insert or overwrite rows now (with their namespaces); returns how many."""
        batch = _Batch(blocks={(r.block_id, r.tier): r for r in records})
        if not batch.blocks:
            return 0
        with self._writer.transaction() as conn:
            return self._write(conn, batch)

    def delete_blocks(self, tier: str, block_ids: Iterable[BlockHash]) -> int:
        """Delete a tier's rows of ``block_ids`` now; returns how many ids were given."""
        batch = _Batch(blocks={(bytes(b), tier): None for b in block_ids})
        if not batch.blocks:
            return 0
        with self._writer.transaction() as conn:
            return self._write(conn, batch)

    def register_namespace(self, root: bytes, description: dict[str, Any] | None = None) -> None:
        """Record a namespace (its root digest and, say, the ``Namespace`` fields) now; while
        the catalog is unavailable, with the next batch written (before any block row of the
        root, which can only come later), so that a tenant's new namespace is served."""
        tenant = description.get("tenant") if isinstance(description, dict) else None
        params = {
            "root": bytes(root),
            "description": description,
            "created": self._clock.now(),
            "tenant": tenant if isinstance(tenant, str) else None,
        }
        try:
            with self._writer.transaction() as conn:
                conn.execute(self._stmts.upsert_namespace_description, [params])
        except CatalogUnavailable:
            with self._qlock:
                self._pending.namespaces[bytes(root)] = params

    @answered
    @retried_on_disconnect
    def namespaces(self) -> dict[bytes, dict[str, Any] | None]:
        t = namespaces_table
        with self.engine.connect() as conn:
            rows = conn.execute(select(t.c.root, t.c.description)).all()
        return {bytes(r.root): r.description for r in rows}

    # -- flushing -----------------------------------------------------------------------

    def pending(self) -> int:
        """Changes queued and not yet written."""
        with self._qlock:
            return len(self._pending)

    def stats(self) -> CatalogStats:
        return CatalogStats(
            self.pending(), self._flushes, self._rows_written, self._errors, self._last_error
        )

    def flush(self) -> int:
        """Write everything queued, now, in one transaction; returns the rows written.

        On failure the changes go back to the queue and the error is raised
        (``CatalogUnavailable`` when the catalog is).
        """
        with self._writer.turn():
            with self._qlock:
                batch, self._pending = self._pending, _Batch()
            if not len(batch):
                return 0
            try:
                with self.health.answering(write=True):
                    written = _commit(self, batch)
            except BaseException as exc:
                self._requeue(batch)
                self._errors += 1
                self._last_error = f"{type(exc).__name__}: {exc}"
                raise
            self._flushes += 1
            self._rows_written += written
            return written

    def _flush_behind(self) -> None:
        """The flusher's step: ``flush``, quiet while the catalog is unavailable (its health
        logs the change, the changes stay queued), once a ``RETRY_S`` then, after a write
        that changes nothing: the catalog is found back at once, before the backlog of the
        outage is written."""
        health = self.health
        if not health.due():
            return
        try:
            if health.problem() is not None:
                self._writer.probe()
            self.flush()
        except CatalogUnavailable:
            pass

    def start(self) -> None:
        """Start the flusher thread (idempotent)."""
        with self._state_lock:
            if self._closed:
                raise CatalogError("the catalog is closed")
            self._flusher.start()

    def close(self) -> None:
        """Stop the flusher, write what is pending and release the engine (if owned)."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        self._flusher.stop(timeout_s=None)
        try:
            self.flush()
        finally:
            if self._owns_engine:
                self.engine.dispose()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------

    def _bucket(self, when: float) -> float:
        return math.floor(when / self._bucket_s) * self._bucket_s

    def _counter_names(self, tier: str) -> tuple[str, str, str]:
        names = self._tier_counters.get(tier)
        if names is None:
            names = (f"blocks_added:{tier}", f"bytes_added:{tier}", f"blocks_removed:{tier}")
            self._tier_counters[tier] = names
        return names

    def _requeue(self, batch: _Batch) -> None:
        """Put a failed batch back behind everything queued since (newer states win)."""
        with self._qlock:
            pending = self._pending
            for bkey, record in batch.blocks.items():
                pending.blocks.setdefault(bkey, record)
            for tkey, touch in batch.touches.items():
                pending.touches.setdefault(tkey, touch)
            for skey, session in batch.sessions.items():
                pending.sessions.setdefault(skey, session)
            for ukey, amount in batch.usage.items():
                pending.usage[ukey] = pending.usage.get(ukey, 0) + amount
            for root, params in batch.namespaces.items():
                pending.namespaces.setdefault(root, params)

    def _write(self, conn: Connection, batch: _Batch) -> int:
        stmts = self._stmts
        written = 0
        if batch.namespaces:
            written += _execute(
                conn, stmts.upsert_namespace_description, list(batch.namespaces.values())
            )
        upserts = [r for r in batch.blocks.values() if r is not None]
        deletes = [{"b_id": k[0], "b_tier": k[1]} for k, r in batch.blocks.items() if r is None]
        if upserts:
            now = self._clock.now()
            roots = {r.namespace_root for r in upserts}
            _execute(
                conn,
                stmts.insert_namespace,
                [{"root": root, "description": None, "created": now} for root in roots],
            )
        if deletes:
            written += _execute(conn, stmts.delete_block, deletes)
        if upserts:
            written += _execute(conn, stmts.upsert_block, [_block_params(r) for r in upserts])
        if batch.touches:
            written += _execute(
                conn,
                stmts.touch_block,
                [
                    {
                        "b_id": block_id,
                        "b_last_access": t[0],
                        "b_expires_at": t[1],
                        "b_hit_count": t[2],
                        "b_pin_count": t[3],
                        "b_ttl_s": t[4],
                    }
                    for block_id, t in batch.touches.items()
                ],
            )
        if batch.sessions:
            written += _execute(
                conn,
                stmts.save_session,
                [
                    {
                        "s_tenant": s.tenant,
                        "s_id": s.id,
                        "s_ttl_s": s.ttl_s,
                        "s_last_seen": s.last_seen,
                        "s_expires_at": s.expires_at,
                        "s_head": s.head,
                    }
                    for s in batch.sessions.values()
                ],
            )
        if batch.usage:
            written += _execute(
                conn,
                stmts.add_usage,
                [
                    {"name": name, "bucket": bucket, "value": value}
                    for (name, bucket), value in batch.usage.items()
                ],
            )
        return written


@retried_on_disconnect
def _commit(catalog: Catalog, batch: _Batch) -> int:
    """Write ``batch`` in one transaction (again on a new connection when its own turns out
    dead, like the reads: a transaction cut off is rolled back)."""
    with catalog.engine.begin() as conn:
        return catalog._write(conn, batch)


def label(url: URL) -> str:
    """The catalog in messages: SQLite's file, else the URL without its password."""
    if url.get_backend_name() == "sqlite" and url.database:
        return url.database
    return url.render_as_string(hide_password=True)


def _reason(exc: SQLAlchemyError) -> str:
    reason = unavailable_reason(exc)
    return reason if reason is not None else str(exc).strip().splitlines()[0]


def _execute(conn: Connection, stmt: Executable, params: list[dict[str, Any]]) -> int:
    for start in range(0, len(params), _CHUNK):
        conn.execute(stmt, params[start : start + _CHUNK])
    return len(params)


def _block_params(r: BlockRecord) -> dict[str, Any]:
    return {
        "block_id": bytes(r.block_id),
        "tier": r.tier,
        "namespace_root": bytes(r.namespace_root),
        "parent": bytes(r.parent) if r.parent is not None else None,
        "nbytes": r.nbytes,
        "checksum": r.checksum,
        "created": r.created,
        "last_access": r.last_access,
        "expires_at": r.expires_at,
        "ttl_s": r.ttl_s,
        "hit_count": r.hit_count,
        "pin_count": r.pin_count,
    }


def _record_of(row: Any) -> BlockRecord:
    return BlockRecord(
        block_id=BlockHash(bytes(row.block_id)),
        tier=row.tier,
        namespace_root=bytes(row.namespace_root),
        parent=BlockHash(bytes(row.parent)) if row.parent is not None else None,
        nbytes=int(row.nbytes),
        created=float(row.created),
        last_access=float(row.last_access),
        expires_at=float(row.expires_at),
        ttl_s=float(row.ttl_s),
        hit_count=int(row.hit_count),
        pin_count=int(row.pin_count),
        checksum=bytes(row.checksum) if row.checksum is not None else None,
    )


if TYPE_CHECKING:

    def _protocols(catalog: Catalog) -> tuple[StoreObserver, SessionRepository]:
        return catalog, catalog.sessions
