"""The node's per-block costs on the same-host write path, and its index RAM per block.

Sections (``--only`` picks some):

* ``handlers``: what the same-host STAGE and COMMIT handlers run on the node
  (``operations.stores.stage`` and ``commit``, in-process, on a node made by ``open_node``),
  for ``--rounds`` stagings of ``--blocks-per-stage`` new blocks each, every block's copy left
  out (COMMIT's ``copy_in`` returns the writer's checksum without copying): microseconds per
  block, wall and this thread's CPU time, medians. Cases: a CPU tier with room and a disk
  tier behind it (the default node: blocks queued for write-behind), the same without a disk
  tier, and a CPU tier kept full without one (every block staged evicts one, dropped). The
  reference, in the same run: one ``RLock`` round, one dict insert and one dict pop per block.
* ``ram``: a store over a shared-memory CPU tier filled with ``--ram-blocks`` blocks of
  64-byte payloads, chains of 2,048, through STAGE and COMMIT: the process's RSS growth per
  block, without the payloads (the index and the tier's map of its slots) and with them;
  beside it the same fill through a tier that keeps nothing (``bench.scale.NullTier``: the
  index alone).

Run: ``python -m bench.stage_commit`` (about a minute), or
``python -m bench.stage_commit --rounds 50 --ram-blocks 102400``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import xxhash

from bench.scale import NullTier, chain_ids, rss_bytes
from sessioncache.config import Settings
from sessioncache.factory import open_node
from sessioncache.hashing import Namespace
from sessioncache.node import OPEN_TENANT, CacheNode
from sessioncache.operations import stores
from sessioncache.operations.caller import Caller
from sessioncache.operations.lookups import resolve
from sessioncache.operations.messages import StoreRequest
from sessioncache.store import TieredStore
from sessioncache.tiers.base import StagedSlot
from sessioncache.tiers.cpu import SharedCpuTier

NAMESPACE = Namespace("bench-stage-commit", 16, "bf16", "x")
ROOT = b"\x01" * 16
PAYLOAD = bytes(range(64))


def reference_us(n: int, repeat: int) -> float:
    """Per block: one ``RLock`` acquire and release, one dict insert, one dict pop."""
    lock = threading.RLock()
    keys = [i.to_bytes(16, "big") for i in range(n)]
    times = []
    for _ in range(repeat):
        table: dict[bytes, int] = {}
        t0 = time.thread_time()
        for slot, key in enumerate(keys):
            with lock:
                table[key] = slot
        for key in keys:
            table.pop(key)
        times.append(time.thread_time() - t0)
    return statistics.median(times) / n * 1e6


def handlers(node: CacheNode, blocks: int, nbytes: int, rounds: int, warm: int) -> dict[str, float]:
    """Median microseconds per block of STAGE and of COMMIT, wall and thread CPU."""
    caller = Caller(OPEN_TENANT, keeps_leases=True)
    root = resolve(node, caller, NAMESPACE)
    checksum = xxhash.xxh3_64_intdigest(bytes(nbytes))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1 << 30, (rounds + warm, blocks * 16), dtype=np.uint32)

    def no_copy(i: int, slot: StagedSlot) -> int:
        return checksum  # the copy and its hash are left out

    figures: dict[str, list[float]] = {
        k: [] for k in ("stage", "stage_cpu", "commit", "commit_cpu")
    }
    for r in range(rounds + warm):
        request = StoreRequest(root, None, 16, blocks, nbytes, tokens[r].tobytes())
        w0, c0 = time.perf_counter(), time.thread_time()
        staged = stores.stage(node, caller, request)
        w1, c1 = time.perf_counter(), time.thread_time()
        stores.commit(
            node, caller, staged.key, 0, [checksum] * blocks, [nbytes] * blocks, copy_in=no_copy
        )
        w2, c2 = time.perf_counter(), time.thread_time()
        if r >= warm:
            for key, value in (
                ("stage", w1 - w0),
                ("stage_cpu", c1 - c0),
                ("commit", w2 - w1),
                ("commit_cpu", c2 - c1),
            ):
                figures[key].append(value)
    return {k: statistics.median(v) / blocks * 1e6 for k, v in figures.items()}


def bench_handlers(blocks: int, nbytes: int, rounds: int) -> list[tuple[str, dict[str, float]]]:
    full_blocks = 16 * blocks
    cases: list[tuple[str, int, int]] = [
        ("cpu with room + disk", 1 << 30, 1 << 30),
        ("cpu with room, no disk", 1 << 30, 0),
        (f"cpu full ({full_blocks} blocks), no disk", full_blocks * nbytes, 0),
    ]
    rows = []
    for label, cpu_bytes, disk_bytes in cases:
        with tempfile.TemporaryDirectory() as tmp:
            node = open_node(
                Settings(data_dir=Path(tmp), cpu_bytes=cpu_bytes, disk_bytes=disk_bytes)
            )
            try:
                warm = 2 * full_blocks // blocks  # fills the small tier first
                rows.append((label, handlers(node, blocks, nbytes, rounds, warm)))
            finally:
                node.close()
    return rows


def fill_staged(store: TieredStore, n: int, chain: int) -> None:
    """``n`` blocks in chains of ``chain``, through stage and commit (the copy: PAYLOAD)."""
    checksum = xxhash.xxh3_64_intdigest(PAYLOAD)
    source = np.frombuffer(PAYLOAD, np.uint8)

    def copy_in(i: int, slot: StagedSlot) -> int:
        np.copyto(slot.payload.numpy(), source)
        return checksum

    for number in range(n // chain):
        ids = chain_ids(chain, number)
        write = store.writes.stage(ids, namespace_root=ROOT, nbytes=len(PAYLOAD))
        store.writes.commit(write, [checksum] * chain, copy_in=copy_in)


def fill_null(store: TieredStore, n: int, chain: int) -> None:
    for number in range(n // chain):
        store.writes.put(chain_ids(chain, number), [PAYLOAD] * chain, namespace_root=ROOT)


def ram(n: int, chain: int, make: Callable[[], TieredStore], fill: Callable[..., None]) -> float:
    """RSS growth per block over the fill (the ids are the store's keys: counted), less the
    payload bytes the store's first tier holds."""
    gc.collect()
    before = rss_bytes()
    store = make()
    fill(store, n, chain)
    gc.collect()
    held = n // chain * chain
    grown = rss_bytes() - before - store.tiers[0].used_bytes
    assert store.stats().blocks == held
    store.close()
    return grown / held


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--blocks-per-stage", type=int, default=64)
    parser.add_argument("--block-bytes", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--ram-blocks", type=int, default=1_048_576)
    parser.add_argument("--chain", type=int, default=2048)
    parser.add_argument("--only", nargs="+", default=["handlers", "ram"])
    parser.add_argument("--ram-case", choices=["shm", "null"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ram_case is not None:  # one RAM case, run by the ``ram`` section
        args.only = []
    if "handlers" in args.only:
        blocks = args.blocks_per_stage
        ref = reference_us(4096, 20)
        print(
            f"\nSTAGE + COMMIT of {blocks} new blocks of {args.block_bytes} bytes, node handlers "
            f"only (no copies), median of {args.rounds}, us per block"
        )
        print(
            f"{'case':<34}{'stage':>8}{'commit':>8}{'total':>8}{'stage cpu':>11}"
            f"{'commit cpu':>12}{'total cpu':>11}{'/ ref':>7}"
        )
        for label, f in bench_handlers(blocks, args.block_bytes, args.rounds):
            cpu = f["stage_cpu"] + f["commit_cpu"]
            print(
                f"{label:<34}{f['stage']:>8.1f}{f['commit']:>8.1f}{f['stage'] + f['commit']:>8.1f}"
                f"{f['stage_cpu']:>11.1f}{f['commit_cpu']:>12.1f}{cpu:>11.1f}{cpu / ref:>7.0f}"
            )
        print(f"{'reference: RLock + dict insert + pop':<34}{'':>38}{ref:>11.2f}{1:>7}")
    if "ram" in args.only:
        n = args.ram_blocks // args.chain * args.chain
        # each in a process of its own: a store's freed memory stays in the process's RSS
        sizes = ["--ram-blocks", str(n), "--chain", str(args.chain)]
        shm, null = (
            float(
                subprocess.run(
                    [sys.executable, "-m", "bench.stage_commit", "--ram-case", case, *sizes],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
            )
            for case in ("shm", "null")
        )
        print(f"\nRAM per block at {n} blocks of {len(PAYLOAD)} bytes (RSS growth)")
        print(f"{'shared-memory CPU tier, payloads left out':<48}{shm:>8.0f} B/block")
        print(f"{'the same with its payloads':<48}{shm + len(PAYLOAD):>8.0f} B/block")
        print(f"{'reference: the index alone (NullTier)':<48}{null:>8.0f} B/block")
    if args.ram_case == "shm":
        n = args.ram_blocks
        print(ram(n, args.chain, lambda: TieredStore([SharedCpuTier(2 * n * 64)]), fill_staged))
    elif args.ram_case == "null":
        print(ram(args.ram_blocks, args.chain, lambda: TieredStore([NullTier()]), fill_null))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
