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
  blocks into a node whose CPU tier holds 256 MiB, timed until the last block is on disk;
  ``steady.kept`` is the share of blocks the node kept. A chain longer than the tier cannot be
  staged whole on the same host: its tail would evict its own head.
  Reference: ``dd``.
- ``steady_busy``: the same while another process writes to the data dir's disk (256 MiB
  files, each ``fdatasync``-ed, in a loop). Reference: ``dd`` beside that writer.

Run: ``python -m bench.ingest [--blocks 256] [--rounds 3] [--cases burst,steady] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
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
WRITER = """
import os, sys
chunk = os.urandom(1 << 20)
while True:
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for _ in range(256):
        os.write(fd, chunk)
    os.fdatasync(fd)
    os.close(fd)
"""
"""A competing writer: 256 MiB files, each ``fdatasync``-ed, in a loop."""


class CompetingWriter:
    """Another process writing to ``directory``'s disk until closed (``WRITER``)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "competing-writer"
        self.proc = subprocess.Popen([sys.executable, "-c", WRITER, str(self.path)])
        time.sleep(0.5)  # under way: its dirty pages ahead of the node's

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(30)
        self.path.unlink(missing_ok=True)


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


def steady(
    url: str, data_dir: Path, blocks: list[np.ndarray], gib: float, busy: bool
) -> dict[str, float]:
    """Chains of 64 blocks (128 MiB) into a 256 MiB CPU tier: each evicts older chains;
    ``busy``: beside a ``CompetingWriter`` on the data dir's disk."""
    name = "steady_busy" if busy else "steady"
    rng = np.random.default_rng(2)
    blocks = blocks[:STEADY_CHAIN]
    n = len(blocks)
    chains = max(1, int(gib * (1 << 30)) // (n * BLOCK))
    kv = transfer(url, "same_host", "ingest-steady")
    writer = None
    kept = 0
    try:
        warm = kv.store_from(chain_tokens(rng, n), blocks)  # faults memory in
        assert warm.blocks == n
        drained(url)
        writer = CompetingWriter(data_dir) if busy else None
        t0 = time.perf_counter()
        for _ in range(chains):
            kept += kv.store_from(chain_tokens(rng, n), blocks).blocks
        drained(url)
        seconds = time.perf_counter() - t0
        dd = min(dd_fdatasync(data_dir, blocks * chains) for _ in range(2))
    finally:
        if writer is not None:
            writer.close()
        kv.close()
        kv.client.close()
    total = chains * n * BLOCK
    return {
        name: total / seconds / 1e9,
        f"{name}_dd": total / dd / 1e9,
        f"{name}.kept": kept / (chains * n),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steady-gib", type=float, default=1.5)
    parser.add_argument(
        "--cases", default="burst,steady", help="comma-separated: burst, steady (idle and busy)"
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(args.blocks)]
    results: dict[str, float] = {}
    chosen = set(args.cases.split(","))
    cases: list[tuple[int, Callable[[str, Path], dict[str, float]]]] = []
    if "burst" in chosen:
        cases.append((4 << 30, lambda url, d: burst(url, d, blocks, args.rounds)))
    if "steady" in chosen:  # the tier full, on an idle disk and beside a competing writer
        for busy in (False, True):
            cases.append(
                (256 << 20, partial(steady, blocks=blocks, gib=args.steady_gib, busy=busy))
            )
    for cpu_bytes, case in cases:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
            data_dir = Path(tmp) / "data"
            proc, url = start(data_dir, cpu_bytes=cpu_bytes, extra_env=README_NODE)
            try:
                results.update(case(url, data_dir))
            finally:
                proc.terminate()
                proc.wait(30)
    pairs = {
        "same_host.over_memcpy": ("same_host", "memcpy"),
        "stream.over_socket": ("stream", "socket"),
        "durable.over_dd": ("durable", "dd"),
        "steady_busy.over_dd": ("steady_busy", "steady_busy_dd"),
        "steady.over_dd": ("steady", "steady_dd"),
    }
    ratios = {k: results[a] / results[b] for k, (a, b) in pairs.items() if a in results}
    print(f"README node, {args.blocks} blocks of 2 MiB per store, best of {args.rounds}, GB/s")
    for key, value in results.items():
        print(f"{key:<24} {value:8.{3 if key.endswith('.kept') else 2}f}")
    for key, value in ratios.items():
        print(f"{key:<24} {value:8.3f}")
    if args.json:
        print(json.dumps({**results, **ratios}))


if __name__ == "__main__":
    main()
