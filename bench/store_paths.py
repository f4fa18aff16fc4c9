"""A store of a fresh chain through ``KVTransfer.store_from`` on each path (REST, the stream,
same host): 64 blocks of 256 KiB (16 MiB) from a real ``sessioncache serve``, timed end to end
in the client, every round a chain the node does not hold yet. First on the node a user starts
(README defaults: the disk tier on, durable uploads, so every block is on disk before its
answer), then, labelled ``cpu_only``, on one without its disk tier.

Beside each node, the references of the same round, on the same bytes: ``memcpy`` (numpy
copies of the blocks) and ``dd_fdatasync`` (the 16 MiB written to a file in the node's data
directory and ``os.fdatasync``-ed, what a durable store cannot beat). ``<path>.over_ref`` is
the store's best time over its node's reference (``dd_fdatasync`` on the README node,
``memcpy`` on the CPU-only one).

Run: ``python -m bench.store_paths [--rounds 8] [--json]``. It uses only the public client
API, so it runs against another tree's code as well: ``python -m bench.compare
bench/store_paths.py --compare-tree DIR --lower _ms over_ref`` runs it from both trees in turns.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.lookup import start
from sessioncache.connector import SessionCacheClient
from sessioncache.connector.transfer import KVTransfer
from sessioncache.hashing import Namespace

BLOCK_TOKENS, BLOCKS, SIZE = 64, 64, 256 * 1024
DEFAULT_NODE = {"SESSIONCACHE_DISK_BYTES": str(64 << 30), "SESSIONCACHE_DURABLE_UPLOADS": "true"}
"""The README's defaults, which ``bench.lookup.start`` turns off."""
PATHS = ("rest", "stream", "same_host")


def dd_fdatasync(directory: Path, blocks: list[np.ndarray]) -> float:
    """Seconds to write ``blocks`` to a new file in ``directory`` and fdatasync it."""
    target = directory / "dd-reference"
    t0 = time.perf_counter()
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for block in blocks:
            os.write(fd, block.data)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    target.unlink()
    return seconds


def memcpy(blocks: list[np.ndarray], out: list[np.ndarray]) -> float:
    t0 = time.perf_counter()
    for src, dst in zip(blocks, out, strict=True):
        np.copyto(dst, src)
    return time.perf_counter() - t0


def measure(url: str, data_dir: Path, rounds: int, durable: bool) -> dict[str, float]:
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 256, SIZE, dtype=np.uint8) for _ in range(BLOCKS)]
    out = [np.empty(SIZE, np.uint8) for _ in range(BLOCKS)]
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    times.update(memcpy=[], dd_fdatasync=[])
    transfers = {}
    for path in PATHS:
        namespace = Namespace(f"store-paths-{path}", BLOCK_TOKENS, "bf16", "x")
        client = SessionCacheClient(url, namespace=namespace, timeout=300)
        transfers[path] = KVTransfer(client, path=path)  # type: ignore[arg-type]
    try:
        for r in range(rounds + 1):  # round 0 faults the tiers in: not counted
            for path, kv in transfers.items():
                tokens = [int(t) for t in rng.integers(0, 50_000, BLOCK_TOKENS * BLOCKS)]
                t0 = time.perf_counter()
                kept = kv.store_from(tokens, blocks).blocks
                seconds = time.perf_counter() - t0
                if kept != BLOCKS:
                    raise RuntimeError(f"{path}: {kept} of {BLOCKS} blocks kept")
                if r:
                    times[path].append(seconds)
            if r:
                times["memcpy"].append(memcpy(blocks, out))
                times["dd_fdatasync"].append(dd_fdatasync(data_dir, blocks))
    finally:
        for kv in transfers.values():
            kv.close()
            kv.client.close()
    figures = {
        f"{case}.{stat}_ms": round(fn(ts) * 1e3, 3)
        for case, ts in times.items()
        for stat, fn in (("min", min), ("median", statistics.median))
    }
    reference = min(times["dd_fdatasync" if durable else "memcpy"])
    for path in PATHS:
        figures[f"{path}.over_ref"] = round(min(times[path]) / reference, 3)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    results: dict[str, float] = {}
    nodes = {"": DEFAULT_NODE, "cpu_only.": {}}  # bench.lookup.start leaves the disk tier out
    for label, env in nodes.items():
        with tempfile.TemporaryDirectory() as tmp:
            data_dir = Path(tmp) / "data"
            cpu = 4 * BLOCKS * SIZE * (args.rounds + 1)  # every round's chains stay in memory
            proc, url = start(data_dir, cpu_bytes=cpu, extra_env=env)
            try:
                figures = measure(url, data_dir, args.rounds, durable=bool(env))
            finally:
                proc.terminate()
                proc.wait(10)
        results.update({f"{label}{k}": v for k, v in figures.items()})
    print(f"{BLOCKS} blocks of {SIZE >> 10} KiB per store, best and median of {args.rounds}, ms")
    for key, value in results.items():
        print(f"{key:<34} {value:10.3f}")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
