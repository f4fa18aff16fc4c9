"""Stores on the node a user starts (README defaults: disk tier on, write-behind), through
``KVTransfer.store_from``: 2 MiB blocks in chains of ``--blocks`` (256), each figure beside its
reference measured in the same run on the same bytes.

Cases (GB/s of payload; each round a fresh chain):

- ``same_host`` / ``stream``: a store answered once memory holds it (write-behind), the queue
  drained between rounds (a burst). References: ``memcpy`` (numpy copies of the chain's
  blocks) and ``socket`` (a plain loopback socket from another process, ``recv_into``).
- ``durable``: the same-host store with ``durable=True`` (answered once on disk). Reference:
  ``dd`` (the chain's bytes to one file in the data dir, one ``fdatasync``).
- ``steady``: ingest with the CPU tier full: ``--steady-gib`` (1.5) stored in chains of 64
  blocks into a node whose CPU tier holds 256 MiB, timed until the last block is on disk
  (every block kept there). A chain longer than the tier cannot be staged whole on the same
  host: its tail would evict its own head.
  Reference: ``dd``.

Run: ``python -m bench.ingest [--blocks 256] [--rounds 3] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from bench.dataplane import SocketReference
from bench.lookup import start
from bench.store_paths import dd_fdatasync, memcpy
from sessioncache.connector import SessionCacheClient
from sessioncache.connector.transfer import KVTransfer
from sessioncache.hashing import Namespace

BLOCK = 2 << 20
BLOCK_TOKENS = 32
STEADY_CHAIN = 64
README_NODE = {"SESSIONCACHE_DISK_BYTES": str(64 << 30)}
"""The README's defaults that ``bench.lookup.start`` turns off (the disk tier)."""


def backlog(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sessioncache_write_behind_bytes{")
    )


def drained(url: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while backlog(url) > 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the write-behind queue did not drain")
        time.sleep(0.02)


def transfer(url: str, path: str, name: str) -> KVTransfer:
    client = SessionCacheClient(
        url, namespace=Namespace(name, BLOCK_TOKENS, "bf16", "x"), timeout=600
    )
    return KVTransfer(client, path=path)  # type: ignore[arg-type]


def chain_tokens(rng: np.random.Generator, blocks: int) -> list[int]:
    return [int(t) for t in rng.integers(0, 50_000, BLOCK_TOKENS * blocks)]


def burst(url: str, data_dir: Path, blocks: list[np.ndarray], rounds: int) -> dict[str, float]:
    rng = np.random.default_rng(1)
    n = len(blocks)
    total = n * BLOCK
    out = [np.empty(BLOCK, np.uint8) for _ in range(n)]
    sock = SocketReference(n, BLOCK, rounds + 1)
    kvs = {
        "same_host": transfer(url, "same_host", "ingest-sh"),
        "stream": transfer(url, "stream", "ingest-stream"),
        "durable": transfer(url, "same_host", "ingest-durable"),
    }
    best: dict[str, float] = {}
    try:
        for r in range(rounds + 1):  # round 0 faults memory in: not counted
            times: dict[str, float] = {}
            for case, kv in kvs.items():
                drained(url)
                tokens = chain_tokens(rng, n)
                t0 = time.perf_counter()
                kept = kv.store_from(tokens, blocks, durable=case == "durable").blocks
                times[case] = time.perf_counter() - t0
                if kept != n:
                    raise RuntimeError(f"{case}: {kept} of {n} blocks kept")
            times["memcpy"] = memcpy(blocks, out)
            times["socket"] = sock.run()
            times["dd"] = dd_fdatasync(data_dir, blocks)
            if r:
                for k, v in times.items():
                    best[k] = min(best.get(k, v), v)
    finally:
        sock.close()
        for kv in kvs.values():
            kv.close()
            kv.client.close()
    return {k: total / v / 1e9 for k, v in best.items()}


def steady(url: str, data_dir: Path, blocks: list[np.ndarray], gib: float) -> dict[str, float]:
    """Chains of 64 blocks (128 MiB) into a 256 MiB CPU tier: each evicts older chains."""
    rng = np.random.default_rng(2)
    blocks = blocks[:STEADY_CHAIN]
    n = len(blocks)
    chains = max(1, int(gib * (1 << 30)) // (n * BLOCK))
    kv = transfer(url, "same_host", "ingest-steady")
    try:
        warm = kv.store_from(chain_tokens(rng, n), blocks)  # faults memory in
        assert warm.blocks == n
        drained(url)
        t0 = time.perf_counter()
        for _ in range(chains):
            kept = kv.store_from(chain_tokens(rng, n), blocks).blocks
            if kept != n:
                raise RuntimeError(f"steady: {kept} of {n} blocks kept")
        drained(url)
        seconds = time.perf_counter() - t0
    finally:
        kv.close()
        kv.client.close()
    dd = min(dd_fdatasync(data_dir, blocks * chains) for _ in range(2))
    total = chains * n * BLOCK
    return {"steady": total / seconds / 1e9, "steady_dd": total / dd / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steady-gib", type=float, default=1.5)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(args.blocks)]
    results: dict[str, float] = {}
    cases: list[tuple[int, Callable[[str, Path], dict[str, float]]]] = [
        (4 << 30, lambda url, d: burst(url, d, blocks, args.rounds)),
        (256 << 20, lambda url, d: steady(url, d, blocks, args.steady_gib)),  # the tier full
    ]
    for cpu_bytes, case in cases:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
            data_dir = Path(tmp) / "data"
            proc, url = start(data_dir, cpu_bytes=cpu_bytes, extra_env=README_NODE)
            try:
                results.update(case(url, data_dir))
            finally:
                proc.terminate()
                proc.wait(30)
    ratios = {
        "same_host.over_memcpy": results["same_host"] / results["memcpy"],
        "stream.over_socket": results["stream"] / results["socket"],
        "durable.over_dd": results["durable"] / results["dd"],
        "steady.over_dd": results["steady"] / results["steady_dd"],
    }
    print(f"README node, {args.blocks} blocks of 2 MiB per store, best of {args.rounds}, GB/s")
    for key, value in results.items():
        print(f"{key:<24} {value:8.2f}")
    for key, value in ratios.items():
        print(f"{key:<24} {value:8.3f}")
    if args.json:
        print(json.dumps({**results, **ratios}))


if __name__ == "__main__":
    main()
