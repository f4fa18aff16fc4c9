"""How the node's costs grow with what it holds (issue 15).

Sections (``--only`` picks some):

* ``index``: a ``TieredStore`` over one tier that keeps no bytes (``NullTier``), so that only
  the store's bookkeeping counts, filled with chains of ``--chain`` blocks of 64-byte payloads up
  to each of ``--blocks``: RAM per block (RSS delta over the fill), put cost per block, and the
  cost per block of looking up a whole ``--chain``-block chain (median of ``--repeat``).
* ``sweep``: a ``SessionManager`` with each of ``--sessions`` sessions open, 1% of them due:
  the time of one ``sweep`` (the session pass and the store's block expiry).
* ``restart``: a disk tier with each of ``--disk-blocks`` 64-byte blocks written through a node
  with a catalog (SQLite, and PostgreSQL when ``--postgres`` is given), then the node is closed,
  the page cache dropped when permitted, and a new node opened: seconds until it serves a
  lookup, and the blocks read back byte-exact.
* ``catalog``: the catalog's write-behind of block rows, rows per second, on each database.

Each section prints, per size, the figure and its ratio to the smallest size's, measured in the
same run: a flat cost has ratio ~1.

Run: ``python -m bench.scale`` (full sizes: minutes on two cores), or
``python -m bench.scale --blocks 10000 100000 --sessions 10000 --disk-blocks 2000 --only index``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Iterator, Sequence

import torch

from sessioncache.hashing import BlockHash
from sessioncache.store import TieredStore
from sessioncache.tiers.payload import Payload, payload_nbytes

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

    def put(
        self,
        block_hash: BlockHash,
        payload: Payload,
        namespace_root: bytes,
        *,
        parent: BlockHash | None = None,
        expires_at: float | None = None,
    ) -> None:
        self.used_bytes += payload_nbytes(payload)

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
        store.put(ids, payloads, namespace_root=NS)
        yield ids


def bench_index(sizes: Sequence[int], chain: int, repeat: int) -> list[dict[str, float]]:
    rows: list[dict[str, float]] = []
    for size in sizes:
        gc.collect()
        store = TieredStore([NullTier()])
        before = rss_bytes()
        t0 = time.perf_counter()
        chains = list(fill(store, 0, size, chain))
        put_s = time.perf_counter() - t0
        gc.collect()
        n = len(chains) * chain
        ram = (rss_bytes() - before) / n
        # the ids themselves are the caller's (kept here to look them up): not bookkeeping
        ram -= sum(sys_size(ids) for ids in chains[:1]) / chain
        times = []
        for r in range(repeat):
            ids = chains[(r * 7919) % len(chains)]
            t0 = time.perf_counter()
            match = store.lookup(ids)
            times.append(time.perf_counter() - t0)
            assert match.num_blocks == chain
        rows.append(
            {
                "blocks": n,
                "ram_b": ram,
                "put_us": put_s / n * 1e6,
                "lookup_us": statistics.median(times) / chain * 1e6,
            }
        )
        del store, chains
        gc.collect()
    return rows


def sys_size(ids: list[BlockHash]) -> int:
    import sys

    return sys.getsizeof(ids) + sum(sys.getsizeof(i) for i in ids)


def print_rows(title: str, rows: list[dict[str, float]], keys: Sequence[str]) -> None:
    print(f"\n{title}")
    head = f"{'blocks':>10}" + "".join(f"{k:>14}{'ratio':>8}" for k in keys)
    print(head)
    for row in rows:
        line = f"{int(row['blocks']):>10}"
        for k in keys:
            line += f"{row[k]:>14.3f}{row[k] / rows[0][k]:>8.2f}"
        print(line)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--blocks", type=int, nargs="+", default=[10_000, 100_000, 1_000_000, 4_000_000]
    )
    parser.add_argument("--chain", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--only", nargs="+", default=["index", "sweep", "restart", "catalog"])
    args = parser.parse_args(argv)
    if "index" in args.only:
        rows = bench_index(args.blocks, args.chain, args.repeat)
        print_rows(
            "index (per block: RAM bytes, put us, lookup us)",
            rows,
            ["ram_b", "put_us", "lookup_us"],
        )


if __name__ == "__main__":
    main()
