"""What each design for blocks nobody changes under their readers would cost a same-host load
or store, measured on the node a user starts (README defaults: disk tier on, durable uploads).

A trusted same-host client maps the CPU tier's segments writable (it fills its staging slots
in place), so it can also write over a published block. The two designs:

- ``checksum``: every read checks the block's XXH3-64 (the node for REST and stream reads, the
  same-host client after its copy, against the checksum LOCATE answers). Cost: a hash of each
  block read, beside the copy. Measured: ``load_into`` with and without ``verify=True``.
- ``readonly``: published memory is mapped read-only by clients, staging lives in memory of its
  own, and a COMMIT copies the slot into published memory. Cost: one more copy per stored
  block. Measured here as its floor: a memcpy of the stored bytes beside the store.

References of the same round on the same bytes: ``memcpy`` (numpy copies of the blocks) and
``xxh3`` (XXH3-64 of each block). Run: ``python -m bench.integrity [--rounds 8] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

from bench.lookup import start
from bench.store_paths import DEFAULT_NODE, memcpy
from sessioncache.connector import SameHostClient
from sessioncache.hashing import Namespace

BLOCK_TOKENS, BLOCKS, SIZE = 64, 64, 256 * 1024


def measure(url: str, rounds: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 256, SIZE, dtype=np.uint8) for _ in range(BLOCKS)]
    out = [np.empty(SIZE, np.uint8) for _ in range(BLOCKS)]
    times: dict[str, list[float]] = {
        k: [] for k in ("store", "load", "load_verified", "memcpy", "xxh3")
    }
    with SameHostClient.discover(url, timeout=300) as client:
        root = client.resolve(Namespace("integrity", BLOCK_TOKENS, "bf16", "x"))
        for r in range(rounds + 1):  # round 0 faults the tiers in: not counted
            tokens = [int(t) for t in rng.integers(0, 50_000, BLOCK_TOKENS * BLOCKS)]
            t0 = time.perf_counter()
            ack = client.store(root, tokens, blocks)
            stored = time.perf_counter() - t0
            if ack.kept != BLOCKS:
                raise RuntimeError(f"{ack.kept} of {BLOCKS} blocks kept")
            ids = client.block_hashes(root, tokens)
            found: dict[str, float] = {}
            for case, verify in (("load", False), ("load_verified", True)):
                t0 = time.perf_counter()
                located = client.locate(root, ids)
                client.load_into(located, out, verify=verify)
                found[case] = time.perf_counter() - t0
            t0 = time.perf_counter()
            for b in blocks:
                xxhash.xxh3_64_intdigest(b)
            hashed = time.perf_counter() - t0
            if r:
                times["store"].append(stored)
                times["load"].append(found["load"])
                times["load_verified"].append(found["load_verified"])
                times["memcpy"].append(memcpy(blocks, out))
                times["xxh3"].append(hashed)
    figures = {
        f"{case}.{stat}_ms": round(fn(ts) * 1e3, 3)
        for case, ts in times.items()
        for stat, fn in (("min", min), ("median", statistics.median))
    }
    best = {case: min(ts) for case, ts in times.items()}
    figures["checksum.load_over_plain"] = round(best["load_verified"] / best["load"], 3)
    figures["readonly.store_floor_over_plain"] = round(
        (best["store"] + best["memcpy"]) / best["store"], 3
    )
    figures["load.over_memcpy"] = round(best["load"] / best["memcpy"], 3)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cpu = 4 * BLOCKS * SIZE * (args.rounds + 1)
        proc, url = start(Path(tmp) / "data", cpu_bytes=cpu, extra_env=DEFAULT_NODE)
        try:
            figures = measure(url, args.rounds)
        finally:
            proc.terminate()
            proc.wait(10)
    print(f"{BLOCKS} blocks of {SIZE >> 10} KiB, same host, README node; best and median ms")
    for key, value in figures.items():
        print(f"{key:<36} {value:10.3f}")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
