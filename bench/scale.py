"""How the node's costs grow with what it holds (issue 15).

Sections (``--only`` picks some):

* ``index``: a ``TieredStore`` over one tier that keeps no bytes (``NullTier``), so that only
  the store's bookkeeping counts, filled with chains of ``--chain`` blocks of 64-byte payloads up
  to each of ``--blocks``: RAM per block (RSS delta over the fill, the 16-byte ids included),
  put cost per block, and the cost per block of looking up a whole ``--chain``-block chain
  (median of ``--repeat``, the chains taken in turn) beside the floor, a bare ``dict.get`` of
  the same ids in the store's id-to-slot dict (``dict_us``). At 10K blocks the 5 chains stay
  in the CPU caches, at 4M they do not; ``cold_*`` time the same after streaming through more
  memory than the caches hold (data and code both cold, at every size).
* ``sweep``: a ``SessionManager`` with each of ``--sessions`` sessions open, 1% of them due:
  the time of one ``sweep`` (the session pass and the store's block expiry).
* ``restart``: a disk tier with each of ``--disk-blocks`` 64-byte blocks written through a node
  with a catalog (SQLite, and PostgreSQL when ``--postgres`` is given), then the node is closed,
  the page cache dropped when permitted, and a new node opened: seconds until it serves a
  lookup, and the blocks read back byte-exact; then the parts before the store's index, each
  timed alone: the catalog read, the disk tier's adoption, the per-block objects.
* ``catalog``: the catalog's write-behind of block rows, rows per second, on each database.

Each section prints, per size, the figure and its ratio to the smallest size's, measured in the
same run: a flat cost has ratio ~1. The stores run the node's default eviction policy
(``forecast``), or the one ``SESSIONCACHE_EVICTION_POLICY`` names (``lru``); ``bench.compare``
against an older tree compares the two.

Run: ``python -m bench.scale`` (full sizes: minutes on two cores), or
``python -m bench.scale --blocks 10000 100000 --sessions 10000 --disk-blocks 2000 --only index``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from sessioncache.clock import ManualClock
from sessioncache.hashing import BlockHash
from sessioncache.sessions.manager import SessionManager
from sessioncache.store import TieredStore
from sessioncache.store.eviction import EvictionPolicy
from sessioncache.tiers.base import PutItem
from sessioncache.tiers.payload import payload_nbytes

PAYLOAD = bytes(range(64))
NS = b"\x01" * 16


class NullTier:
    """A tier that accepts every block and keeps none of its bytes: the store's bookkeeping
    alone is measured."""

    durable = False

    def __init__(self, name: str = "null") -> None:
        self.name = name
        self.capacity_bytes = 1 << 60
        self.used_bytes = 0

    def fits(self, nbytes: int) -> bool:
        return True

    def contains(self, block_hash: BlockHash) -> bool:
        return False

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        return None

    def put(self, item: PutItem) -> None:
        self.used_bytes += payload_nbytes(item.payload)

    def delete(self, block_hash: BlockHash) -> int:
        return 0

    def keys(self) -> list[BlockHash]:
        return []

    def close(self) -> None:
        pass


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def chain_ids(chain: int, number: int) -> list[BlockHash]:
    """Distinct 16-byte ids of chain ``number`` (not real prefix hashes: only distinctness
    matters to the bookkeeping)."""
    base = number.to_bytes(8, "big")
    return [base + i.to_bytes(8, "big") for i in range(chain)]


def fill(store: TieredStore, start: int, stop: int, chain: int) -> Iterator[list[BlockHash]]:
    payloads = [PAYLOAD] * chain
    for number in range(start // chain, stop // chain):
        ids = chain_ids(chain, number)
        store.writes.put(ids, payloads, namespace_root=NS)
        yield ids


_EVICT = bytearray()


def evict_caches(nbytes: int = 256 << 20) -> None:
    """Stream through more memory than the CPU's caches hold (L3 is 105 MiB here), so that
    the next lookup starts as cold at every index size."""
    global _EVICT
    if len(_EVICT) != nbytes:
        _EVICT = bytearray(nbytes)
    view = np.frombuffer(_EVICT, np.uint64)
    view += 1


def _policy() -> EvictionPolicy:
    """The node's default eviction policy, or the one ``SESSIONCACHE_EVICTION_POLICY`` names
    (a tree from before the choice, run by ``bench.compare``, has LRU only)."""
    named = getattr(EvictionPolicy, "named", None)
    if named is None:
        return EvictionPolicy(1)
    policy: EvictionPolicy = named(os.environ.get("SESSIONCACHE_EVICTION_POLICY", "forecast"), 1)
    return policy


def bench_index(sizes: Sequence[int], chain: int, repeat: int) -> list[dict[str, float]]:
    rows: list[dict[str, float]] = []
    # A warm-up, so that the first size's put figure does not carry the first calls' costs;
    # kept alive, so that the first size's RAM is not counted in the memory it frees.
    warm = TieredStore([NullTier()], _policy())
    list(fill(warm, 0, 4 * chain, chain))
    for size in sizes:
        gc.collect()
        store = TieredStore([NullTier()], _policy())
        before = rss_bytes()
        t0 = time.perf_counter()
        chains = list(fill(store, 0, size, chain))
        put_s = time.perf_counter() - t0
        gc.collect()
        n = len(chains) * chain
        # The ids are the store's keys (counted); the lists holding them here are not.
        ram = (rss_bytes() - before - sum(sys.getsizeof(ids) for ids in chains)) / n
        times, floor, cold, cold_floor = [], [], [], []
        blocks = store._core.index._table.slot_of
        for r in range(repeat):
            ids = chains[(r * 7919) % len(chains)]
            t0 = time.perf_counter()
            match = store.reads.lookup(ids)
            times.append(time.perf_counter() - t0)
            assert match.num_blocks == chain
        for r in range(repeat):  # apart: its random probes would disturb the lookups' caches
            ids = chains[(r * 7919) % len(chains)]
            t0 = time.perf_counter()
            found = [blocks.get(h) for h in ids]
            floor.append(time.perf_counter() - t0)
            assert len(found) == chain
        for r in range(0, repeat, 3):  # evicting the caches takes a while: a third as many
            ids = chains[(r * 7919) % len(chains)]
            evict_caches()
            t0 = time.perf_counter()
            store.reads.lookup(ids)
            cold.append(time.perf_counter() - t0)
            evict_caches()
            t0 = time.perf_counter()
            found = [blocks.get(h) for h in ids]
            cold_floor.append(time.perf_counter() - t0)
        rows.append(
            {
                "blocks": n,
                "ram_b": ram,
                "put_us": put_s / n * 1e6,
                "lookup_us": statistics.median(times) / chain * 1e6,
                "dict_us": statistics.median(floor) / chain * 1e6,
                "cold_lookup_us": statistics.median(cold) / chain * 1e6,
                "cold_dict_us": statistics.median(cold_floor) / chain * 1e6,
            }
        )
        del store, chains
        gc.collect()
    warm.close()
    return rows


def print_rows(title: str, rows: list[dict[str, float]], keys: Sequence[str]) -> None:
    print(f"\n{title}")
    head = f"{'blocks':>10}" + "".join(f"{k:>16}{'ratio':>8}" for k in keys)
    print(head)
    for row in rows:
        line = f"{int(row['blocks']):>10}"
        for k in keys:
            line += f"{row[k]:>16.3f}{row[k] / rows[0][k]:>8.2f}"
        print(line)


def bench_sweep(sizes: Sequence[int]) -> list[dict[str, float]]:
    """One sweep with ``n`` sessions (one block each) of which 1% are due; the reference is
    the full scan the sweep used to do (every session and every block), in the same run."""
    rows: list[dict[str, float]] = []
    for n in sizes:
        gc.collect()
        clock = ManualClock(1_000.0)
        store = TieredStore([NullTier()], _policy(), clock=clock)
        sessions = SessionManager(store)
        due = max(1, n // 100)
        for i in range(n):
            short = i % (n // due) == 0
            session = sessions.open(f"s{i}", ttl_s=10.0 if short else 3600.0)
            block = [i.to_bytes(16, "big")]
            store.writes.put(block, [PAYLOAD], namespace_root=NS, ttl_s=10.0 if short else 3600.0)
            del session
        clock.advance(20.0)
        now = clock.now()
        gc.collect()  # the fill's garbage: a full collection is not the sweep's cost
        t0 = time.perf_counter()
        scan = [s for s in sessions._sessions.values() if s.expires_at <= now]
        blocks = store._core.index.records()
        scanned = [m for m in blocks if m.expires_at <= now and not m.ref_cnt]
        ref = time.perf_counter() - t0
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        report = sessions.sweep()
        took, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert report.expired_sessions == len(scan) and report.expired_blocks == len(scanned)
        rows.append(
            {
                "blocks": n,
                "sweep_ms": took * 1e3,
                "sweep_cpu_ms": cpu * 1e3,
                "full_scan_ms": ref * 1e3,
                "due": len(scan),
            }
        )
        del store, sessions
    return rows


def write_disk(data: Path, n: int, catalog_url: str, schema: str | None) -> list[BlockHash]:
    """A data dir as a node leaves it: ``n`` 64-byte blocks in chains of 64 on disk, rows in
    the catalog (written in bulk here: the catalog section times the write-behind)."""
    from sessioncache.catalog.repository import BlockRecord, Catalog
    from sessioncache.tiers.disk import DiskTier

    disk = DiskTier.open(data / "blocks", 1 << 40, fsync=False)
    catalog = Catalog.open(catalog_url, schema=schema, migrate=True)
    ids: list[BlockHash] = []
    now = time.time()
    batch: list[BlockRecord] = []
    parent: BlockHash | None = None
    for i in range(n):
        block = BlockHash(i.to_bytes(16, "big"))
        parent = None if i % 64 == 0 else parent
        disk.put(PutItem(block, PAYLOAD, NS, parent=parent))
        batch.append(
            BlockRecord(block, "disk", NS, parent, len(PAYLOAD), now, now, now + 3600, 3600)
        )
        if len(batch) >= 5000:
            catalog.upsert_blocks(batch)
            batch.clear()
        ids.append(block)
        parent = block
    catalog.upsert_blocks(batch)
    catalog.close()
    disk.close()
    return ids


def drop_page_cache() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def bench_restart(
    sizes: Sequence[int], databases: Sequence[tuple[str, str, str | None]], full_max: int
) -> list[dict[str, float]]:
    """Seconds until a restarted node serves (``open_node`` returns, as ``serve`` does
    before it listens), the background pass, and the old full walk (``start=False``, up to
    ``full_max`` blocks) as the reference; then a sample read back byte-exact."""
    from sessioncache.config import Settings
    from sessioncache.factory import open_node

    rows: list[dict[str, float]] = []
    for label, url, schema in databases:
        for n in sizes:
            with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
                data = Path(tmp)
                db_url = url or f"sqlite:///{data / 'catalog.db'}"
                db_schema = f"{schema}_{n}" if schema else None
                if db_schema:
                    _create_schema(db_url, db_schema)
                ids = write_disk(data, n, db_url, db_schema)
                settings = Settings(
                    data_dir=data,
                    cpu_bytes=1 << 20,
                    disk_bytes=1 << 40,
                    database_url=db_url,
                    database_schema=db_schema,
                )
                dropped = drop_page_cache()
                t0 = time.perf_counter()
                node = open_node(settings)
                serving = time.perf_counter() - t0
                while node.health_problems():
                    time.sleep(0.01)
                background = time.perf_counter() - t0
                sample = ids[:: max(1, n // 1000)]
                assert all(node.store.reads.get_bytes(b) == PAYLOAD for b in sample)
                node.close()
                parts = restart_parts(data, db_url, db_schema, n)
                full = math.nan
                if n <= full_max:
                    drop_page_cache()
                    t0 = time.perf_counter()
                    node = open_node(settings, start=False)
                    full = time.perf_counter() - t0
                    assert all(node.store.reads.get_bytes(b) == PAYLOAD for b in sample)
                    node.close()
                if db_schema:
                    _drop_schema(db_url, db_schema)
            rows.append(
                {
                    "db": label,
                    "blocks": n,
                    "serving_s": serving,
                    "background_s": background,
                    "full_walk_s": full,
                    "cache_dropped": float(dropped),
                    **parts,
                }
            )
    return rows


def restart_parts(data: Path, url: str, schema: str | None, n: int) -> dict[str, float]:
    """The parts of a fast restart before the store's index, each timed alone (page cache
    dropped, collector off as during the store's bulk load): the catalog's rows read into
    columns and the disk tier's adoption of them (the store adopts the same columns); and
    the disk tier's index bytes per block (its dict; the ids are the store's keys too)."""
    from sessioncache.catalog.repository import Catalog
    from sessioncache.tiers.disk import DiskTier

    catalog = Catalog.open(url, schema=schema)
    disk = DiskTier.open(data / "blocks", 1 << 40, scan=False)
    drop_page_cache()
    gc.disable()
    try:
        t0 = time.perf_counter()
        batches = list(catalog.iter_recovered_batches("disk"))
        read = time.perf_counter() - t0
        t0 = time.perf_counter()
        for batch in batches:
            disk.adopt_batch(batch)
        adopt = time.perf_counter() - t0
        blocks = sum(len(batch) for batch in batches)
    finally:
        gc.enable()
    assert blocks == n == len(disk.keys())
    disk_bytes = sys.getsizeof(disk._index) / n
    catalog.close()
    return {"read_s": read, "adopt_s": adopt, "disk_b": disk_bytes}


def _create_schema(url: str, schema: str) -> None:
    import sqlalchemy

    engine = sqlalchemy.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sqlalchemy.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        conn.execute(sqlalchemy.text(f'CREATE SCHEMA "{schema}"'))
    engine.dispose()


def _drop_schema(url: str, schema: str) -> None:
    import sqlalchemy

    engine = sqlalchemy.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sqlalchemy.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    engine.dispose()


def bench_catalog(n: int, databases: Sequence[tuple[str, str, str | None]]) -> list[str]:
    """Rows per second of the catalog's write-behind: ``n`` blocks added (observer calls
    queued) then one ``flush``."""
    from sessioncache.catalog.repository import Catalog
    from sessioncache.store.blocks import BlockMeta
    from sessioncache.store.table import BlockFields

    lines = []
    for label, url, schema in databases:
        with tempfile.TemporaryDirectory() as tmp:
            db_url = url or f"sqlite:///{Path(tmp) / 'catalog.db'}"
            db_schema = f"{schema}_cat" if schema else None
            if db_schema:
                _create_schema(db_url, db_schema)
            catalog = Catalog.open(db_url, schema=db_schema, migrate=True, max_pending=1 << 30)
            now = time.time()
            metas = [
                BlockMeta.detached(
                    BlockFields(i.to_bytes(16, "big"), None, NS, 64, 3600.0, now, now, now + 3600),
                    [0],
                )
                for i in range(n)
            ]
            t0 = time.perf_counter()
            for meta in metas:
                catalog.block_added(meta, "disk", True)
            written = catalog.flush()
            took = time.perf_counter() - t0
            catalog.close()
            if db_schema:
                _drop_schema(db_url, db_schema)
        lines.append(f"{label:<12}{n:>10}{written:>10}{written / took:>14,.0f}")
    return lines


def plot(index: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    xs = [r["blocks"] for r in index]
    for ax, key, title in zip(
        axes,
        ["ram_b", "put_us", "lookup_us"],
        ["RAM per block (bytes)", "put per block (us)", "lookup per block (us)"],
        strict=True,
    ):
        ax.plot(xs, [r[key] for r in index], marker="o", label="sessioncache")
        if key == "lookup_us":
            ax.plot(xs, [r["dict_us"] for r in index], marker=".", label="dict.get floor")
            ax.plot(
                xs,
                [r["cold_lookup_us"] for r in index],
                marker="o",
                linestyle=":",
                label="sessioncache, caches evicted",
            )
        target = {"ram_b": 300.0, "lookup_us": 0.15}.get(key)
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", label="issue 15 target")
            ax.legend(fontsize=8)
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_title(title)
        ax.set_xlabel("blocks held")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--blocks", type=int, nargs="+", default=[10_240, 102_400, 1_024_000, 4_096_000]
    )
    parser.add_argument("--chain", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=90)
    parser.add_argument("--sessions", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--disk-blocks", type=int, nargs="+", default=[10_000, 100_000, 500_000])
    parser.add_argument(
        "--full-walk-max", type=int, default=100_000, help="largest size the old walk is timed at"
    )
    parser.add_argument("--catalog-rows", type=int, default=100_000)
    parser.add_argument("--postgres", help="a PostgreSQL URL: restart and catalog on it too")
    parser.add_argument("--plot", type=Path, help="write the index curves to this PNG")
    parser.add_argument("--only", nargs="+", default=["index", "sweep", "restart", "catalog"])
    parser.add_argument(
        "--json", action="store_true", help="end with the index figures as one JSON line"
    )
    args = parser.parse_args(argv)
    figures: dict[str, float] = {}
    databases: list[tuple[str, str, str | None]] = [("sqlite", "", None)]
    if args.postgres:
        databases.append(("postgresql", args.postgres, f"bench_scale_{os.getpid()}"))
    if "index" in args.only:
        rows = bench_index(args.blocks, args.chain, args.repeat)
        print_rows(
            f"index, {args.chain}-block chains of 64-byte payloads "
            "(per block: RAM bytes, put us, lookup us, also from evicted caches; ratio to the "
            "smallest size)",
            rows,
            ["ram_b", "put_us", "lookup_us", "dict_us", "cold_lookup_us", "cold_dict_us"],
        )
        for row in rows:
            for key in ("put_us", "lookup_us", "dict_us", "cold_lookup_us"):
                figures[f"{key[:-3]}@{int(row['blocks'])}_us"] = row[key]
        if args.plot:
            plot(rows, args.plot)
    if "sweep" in args.only:
        rows = bench_sweep(args.sessions)
        print("\nsweep, 1% of sessions (and their blocks) due (ms; ratio = sweep / full scan)")
        print(
            f"{'sessions':>10}{'due':>8}{'sweep ms':>12}{'(cpu ms)':>10}"
            f"{'full scan ms':>14}{'ratio':>8}"
        )
        for row in rows:
            print(
                f"{int(row['blocks']):>10}{int(row['due']):>8}{row['sweep_ms']:>12.2f}"
                f"{row['sweep_cpu_ms']:>10.2f}{row['full_scan_ms']:>14.2f}"
                f"{row['sweep_ms'] / row['full_scan_ms']:>8.3f}"
            )
    if "restart" in args.only:
        rows = bench_restart(args.disk_blocks, databases, args.full_walk_max)
        print("\nrestart, 64-byte blocks on disk (s; ratio = serving / old full walk)")
        print(
            f"{'db':<12}{'blocks':>10}{'serving s':>11}{'background s':>14}"
            f"{'full walk s':>13}{'ratio':>8}  page cache"
        )
        for row in rows:
            print(
                f"{row['db']!s:<12}{int(row['blocks']):>10}{row['serving_s']:>11.2f}"
                f"{row['background_s']:>14.2f}{row['full_walk_s']:>13.2f}"
                f"{row['serving_s'] / row['full_walk_s']:>8.3f}  "
                f"{'dropped' if row['cache_dropped'] else 'NOT dropped (no permission)'}"
            )
        print(
            "\nrestart, its parts before the store's index, each timed alone (s; "
            "rest = serving - the two: the store's index and the node)"
        )
        print(
            f"{'db':<12}{'blocks':>10}{'catalog read':>14}{'disk adopt':>12}"
            f"{'rest':>8}{'disk B/blk':>12}"
        )
        for row in rows:
            parts = row["read_s"] + row["adopt_s"]
            print(
                f"{row['db']!s:<12}{int(row['blocks']):>10}{row['read_s']:>14.2f}"
                f"{row['adopt_s']:>12.2f}"
                f"{row['serving_s'] - parts:>8.2f}{row['disk_b']:>12.1f}"
            )
    if "catalog" in args.only:
        print("\ncatalog write-behind (block rows added, then one flush)")
        print(f"{'db':<12}{'queued':>10}{'written':>10}{'rows/s':>14}")
        for line in bench_catalog(args.catalog_rows, databases):
            print(line)
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
