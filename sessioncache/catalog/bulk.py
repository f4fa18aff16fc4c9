"""The block rows of a tier read in bulk, as ``RecoveredBatch`` columns: the index of a fast
restart, hundreds of thousands of rows read before the node serves.

* The rows are read on the driver's own cursor (``sqlite3``; psycopg 3 through a server-side
  cursor in binary format, so that the result streams in batches and numbers arrive unparsed
  from text), not through SQLAlchemy's result rows, whose per-row processing cost several
  times the read itself. Any other driver takes the SQLAlchemy path.
* The driver makes a Python object per value with the GIL held, so fewer values is faster:
  the rows sharing the first row's namespace root, size and TTL (most of them, as a rule: one
  model, one block size, few TTLs) are read without those three columns, the others whole.
* A worker thread reads a few batches ahead of the consumer (``read_recovered_prefetched``):
  the database's own work (a server process; SQLite's page reads) overlaps with the store's.
* Each batch is turned into columns at once: the ids as the driver made them (the bytes
  objects the tier and the store then share as keys), one object per distinct namespace root,
  the numbers as numpy arrays.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import closing
from functools import partial
from typing import Any, TypeVar

import numpy as np
from sqlalchemy import Connection, Engine, select

from sessioncache.catalog.models import blocks_table
from sessioncache.tiers.base import RecoveredBatch

log = logging.getLogger("sessioncache.catalog")

BATCH_ROWS = 10_000

_COLUMNS = ("block_id", "namespace_root", "nbytes", "last_access", "parent", "ttl_s", "expires_at")
_SHARED = ("namespace_root", "nbytes", "ttl_s")
_NARROW = ("block_id", "last_access", "parent", "expires_at")
_Row = tuple[bytes, bytes, int, float, bytes | None, float, float]
_T = TypeVar("_T")
PREFETCH = 4


def read_recovered_prefetched(
    engine: Engine, tier: str, batch_rows: int = BATCH_ROWS, depth: int = PREFETCH
) -> Iterator[RecoveredBatch]:
    """``read_recovered`` on a connection of its own, read by a worker thread up to ``depth``
    batches ahead of the consumer: the database's work (a server process; SQLite's page reads
    and decoding, done without the GIL) overlaps with the consumer's."""

    def produce() -> Generator[RecoveredBatch, None, None]:
        with engine.connect() as conn:
            yield from read_recovered(conn, tier, batch_rows)

    return prefetched(produce, depth)


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_DONE = object()


def prefetched(produce: Callable[[], Generator[_T, None, None]], depth: int) -> Iterator[_T]:
    """``produce()``'s items, made on a worker thread up to ``depth`` ahead; its exception is
    raised here, and closing this iterator stops and closes the producer."""
    items: queue.Queue[Any] = queue.Queue(depth)
    stop = threading.Event()

    def hand_over(item: object) -> bool:
        while not stop.is_set():
            try:
                items.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            with closing(produce()) as made:
                for item in made:
                    if not hand_over(item):
                        return
        except BaseException as exc:  # handed to the consumer, raised there
            hand_over(_Failed(exc))
            return
        hand_over(_DONE)

    worker = threading.Thread(target=run, name="sessioncache-catalog-read", daemon=True)
    worker.start()
    try:
        while True:
            item = items.get()
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.exc
            yield item
    finally:
        stop.set()
        worker.join()


def read_recovered(
    conn: Connection, tier: str, batch_rows: int = BATCH_ROWS
) -> Iterator[RecoveredBatch]:
    """The rows of ``tier`` in batches of up to ``batch_rows`` (in no particular order)."""
    driver: Any = conn.connection.driver_connection
    roots: dict[bytes, bytes] = {}
    query: Callable[[str, tuple[Any, ...], int], Iterator[Sequence[tuple[Any, ...]]]]
    if isinstance(driver, sqlite3.Connection):
        query, mark, plus = partial(_sqlite_query, driver), "?", "+"
    elif conn.dialect.name == "postgresql" and conn.dialect.driver == "psycopg":
        query, mark, plus = partial(_psycopg_query, driver), "%s", ""
    else:
        for rows in sqlalchemy_rows(conn, tier, batch_rows):
            yield batch_of(rows, roots)
        return
    # ``+column`` (SQLite): a scan of the table, not a search of an index whose order is not
    # the table's (a random read per row on a cold page cache).
    table, where = blocks_table.name, f"WHERE {plus}tier = {mark}"
    probe = f"SELECT {', '.join(_SHARED)} FROM {table} {where} LIMIT 1"
    first = [row for rows in query(probe, (tier,), 1) for row in rows]
    if not first:
        return
    # The rows of the first row's (root, size, TTL), most of them as a rule, are read
    # without those three columns: fewer values for the driver to make, with the GIL held.
    # Then the others, whole.
    root, nbytes, ttl_s = first[0]
    root = roots.setdefault(bytes(root), bytes(root))
    same = " AND ".join(f"{plus}{c} = {mark}" for c in _SHARED)
    params = (tier, root, nbytes, ttl_s)
    narrow = f"SELECT {', '.join(_NARROW)} FROM {table} {where} AND {same}"
    for rows in query(narrow, params, batch_rows):
        yield _narrow_batch_of(rows, root, int(nbytes), float(ttl_s))
    rest = f"SELECT {', '.join(_COLUMNS)} FROM {table} {where} AND NOT ({same})"
    for rows in query(rest, params, batch_rows):
        yield batch_of(rows, roots)


def _sqlite_query(
    driver: sqlite3.Connection, sql: str, params: tuple[Any, ...], batch_rows: int
) -> Iterator[Sequence[tuple[Any, ...]]]:
    cursor = driver.execute(sql, params)
    try:
        while rows := cursor.fetchmany(batch_rows):
            yield rows
    finally:
        cursor.close()


def _psycopg_query(
    driver: Any, sql: str, params: tuple[Any, ...], batch_rows: int
) -> Iterator[Sequence[tuple[Any, ...]]]:
    # A server-side cursor: the result streams in batches; binary: numbers arrive unparsed.
    with driver.cursor(name="sessioncache_recovered", binary=True) as cur:
        cur.execute(sql, params)
        while rows := cur.fetchmany(batch_rows):
            yield rows


def sqlalchemy_rows(conn: Connection, tier: str, batch_rows: int) -> Iterator[Sequence[_Row]]:
    """The rows through SQLAlchemy, for any other driver."""
    t = blocks_table
    result = conn.execution_options(yield_per=batch_rows).execute(
        select(*(t.c[name] for name in _COLUMNS)).where(t.c.tier == tier)
    )
    for partition in result.partitions():
        yield [tuple(row) for row in partition]  # type: ignore[misc]


def batch_of(rows: Sequence[_Row], roots: dict[bytes, bytes] | None = None) -> RecoveredBatch:
    """Rows ``(block_id, namespace_root, nbytes, last_access, parent, ttl_s, expires_at)`` as
    columns; ``roots`` interns the namespace roots across batches."""
    ids, ns, nbytes, last_access, parents, ttl_s, expires_at = zip(*rows, strict=True)
    if roots is None:
        roots = {}
    first = ns[0]
    if ns.count(first) == len(ns):  # the usual case: one namespace
        first = roots.setdefault(bytes(first), bytes(first))
        namespace_roots = [first] * len(ns)
    else:
        namespace_roots = [roots.setdefault(bytes(r), bytes(r)) for r in ns]
    # A driver returns one type for a column: bytes here (sqlite3, psycopg), else copies.
    if type(ids[0]) is not bytes:
        ids = tuple(bytes(b) for b in ids)
    if type(next((p for p in parents if p is not None), b"")) is not bytes:
        parents = tuple(None if p is None else bytes(p) for p in parents)
    return RecoveredBatch(
        ids=list(ids),
        namespace_roots=namespace_roots,
        parents=list(parents),
        nbytes=np.array(nbytes, dtype=np.int64),
        mtime=np.array(last_access, dtype=np.float64),
        ttl_s=np.array(ttl_s, dtype=np.float64),
        expires_at=np.array(expires_at, dtype=np.float64),
    )


def _narrow_batch_of(
    rows: Sequence[tuple[Any, ...]], root: bytes, nbytes: int, ttl_s: float
) -> RecoveredBatch:
    """Rows ``(block_id, last_access, parent, expires_at)`` of one root, size and TTL."""
    ids, last_access, parents, expires_at = zip(*rows, strict=True)
    if type(ids[0]) is not bytes:
        ids = tuple(bytes(b) for b in ids)
    if type(next((p for p in parents if p is not None), b"")) is not bytes:
        parents = tuple(None if p is None else bytes(p) for p in parents)
    n = len(ids)
    return RecoveredBatch(
        ids=list(ids),
        namespace_roots=[root] * n,
        parents=list(parents),
        nbytes=np.full(n, nbytes, dtype=np.int64),
        mtime=np.array(last_access, dtype=np.float64),
        ttl_s=np.full(n, ttl_s, dtype=np.float64),
        expires_at=np.array(expires_at, dtype=np.float64),
    )
