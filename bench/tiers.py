"""Tier put/get throughput for 2 MiB and 32 MiB blocks, beside each tier's physical reference.

References, measured in the same run on the same bytes (best of three each, as the tiers):
- CPU and GPU tiers: a torch copy of the same total bytes into preallocated, faulted-in memory
  on the tier's device (memcpy bandwidth).
- Disk tier: one sequential write of the same total bytes into a single file followed by one
  fdatasync (put), and one sequential read of that file from the device (get): the file, and
  the tier's files before its gets, are evicted from the page cache first.

Tiers are measured in their steady state (memory faulted in, folders created), and a get
includes the copy into a preallocated host buffer that an engine's load would do.

Run: ``python -m bench.tiers [--total-mib 512] [--threads 1 4] [--dir PATH]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import torch

from sessioncache.hashing import BlockHash
from sessioncache.tiers.base import PutItem, Tier
from sessioncache.tiers.cpu import CpuTier
from sessioncache.tiers.disk import DiskTier
from sessioncache.tiers.gpu import GpuTier

MiB = 1 << 20
NS = b"\x00" * 16


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def memcpy_reference(device: torch.device, block: int, count: int) -> float:
    """Seconds to copy ``count`` blocks of ``block`` bytes into preallocated, faulted-in
    memory, one torch copy per block: what any slab tier's put or get must do at least."""
    src = torch.randint(0, 255, (block,), dtype=torch.uint8, device=device)
    dst = torch.empty((count, block), dtype=torch.uint8, device=device)
    dst[0].copy_(src)  # warm-up: fault the pages in, as the tier's slab is after its first fill
    dst.fill_(0)

    def run() -> None:
        for i in range(count):
            dst[i].copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return min(timed(run) for _ in range(3))


def drop_from_page_cache(folder: Path) -> None:
    """Evict every (clean, fsynced) file under ``folder`` from the page cache, so that the
    next read comes from the device: reads are compared at the device's limit."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_reference(folder: Path, block: bytes, count: int) -> tuple[float, float]:
    """(write + fdatasync seconds, read-from-device seconds) of one file of ``count`` blocks."""
    path = folder / "reference.bin"

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for _ in range(count):
                os.write(fd, block)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    buf = bytearray(len(block))

    def read() -> None:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    w = min(timed(write) for _ in range(3))
    reads = []
    for _ in range(3):
        drop_from_page_cache(folder)
        reads.append(timed(read))
    path.unlink()
    return w, min(reads)


def tier_run(
    make: Callable[[], Tier], block: bytes, count: int, threads: int
) -> tuple[float, float]:
    """(put seconds, get seconds) for ``count`` distinct blocks through a fresh tier, in its
    steady state: a first pass fills the tier (faulting its memory in, creating its folders),
    is deleted, and the second pass is timed, as in a long-running cache."""
    ids = [BlockHash(i.to_bytes(16, "little")) for i in range(count)]
    tier = make()
    # Where an engine loads a block: one preallocated host buffer per reader thread.
    sinks = [torch.empty(len(block), dtype=torch.uint8) for _ in range(max(1, threads))]
    slot = threading.local()
    counter = iter(range(1_000_000))
    try:

        def put(h: BlockHash) -> None:
            tier.put(PutItem(h, block, NS))

        def get(h: BlockHash) -> None:
            if not hasattr(slot, "sink"):
                slot.sink = sinks[next(counter) % len(sinks)]
            got = tier.get(h)
            assert got is not None and got.numel() == len(block)
            slot.sink.copy_(got)  # slab tiers hand out views: the load is this copy

        def each(fn: Callable[[BlockHash], None]) -> float:
            if threads == 1:
                return timed(lambda: [fn(h) for h in ids])
            with ThreadPoolExecutor(threads) as pool:
                return timed(lambda: list(pool.map(fn, ids)))

        each(put)
        for h in ids:
            tier.delete(h)
        puts, gets = [], []
        for _ in range(3):  # best of three, like the references
            puts.append(each(put))
            if isinstance(tier, DiskTier):
                drop_from_page_cache(tier.root)
            gets.append(each(get))
            for h in ids:
                tier.delete(h)
        return min(puts), min(gets)
    finally:
        tier.close()


def main() -> None:
    torch.set_num_threads(1)  # one copy per call, as the tiers do; no intra-op thread pool
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--total-mib", type=int, default=512)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 4])
    parser.add_argument(
        "--dir", type=Path, default=None, help="folder for the disk tier (created if missing)"
    )
    args = parser.parse_args()
    if args.dir is not None:
        try:
            args.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            parser.error(f"--dir {args.dir}: {e.strerror or e}")
    total = args.total_mib * MiB
    scratch = Path(tempfile.mkdtemp(prefix="sc-bench-", dir=args.dir))
    try:
        for block_mib in (2, 32):
            size = block_mib * MiB
            count = max(1, total // size)
            nbytes = count * size
            block = np.random.default_rng(block_mib).integers(0, 256, size, np.uint8).tobytes()
            slab_capacity = nbytes + size
            cpu_ref = memcpy_reference(torch.device("cpu"), size, count)
            gpu_dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
            gpu_ref = memcpy_reference(gpu_dev, size, count)
            disk_w, disk_r = disk_reference(scratch, block, count)
            for threads in args.threads:
                folder = scratch / f"disk-{block_mib}-{threads}"
                makers: list[tuple[str, Callable[[], Tier], float, float]] = [
                    ("gpu", partial(GpuTier, slab_capacity, device=gpu_dev), gpu_ref, gpu_ref),
                    ("cpu", partial(CpuTier, slab_capacity), cpu_ref, cpu_ref),
                    ("disk", partial(DiskTier.open, folder, slab_capacity), disk_w, disk_r),
                ]
                for name, make, ref_put, ref_get in makers:
                    p, g = tier_run(make, block, count, threads)
                    print(
                        f"{name:>5} {block_mib:>3} MiB {threads:>2} thr"
                        f" | put {gbps(nbytes, p):6.2f} GB/s = {ref_put / p:6.1%} of"
                        f" {gbps(nbytes, ref_put):6.2f}"
                        f" | get {gbps(nbytes, g):6.2f} GB/s = {ref_get / g:6.1%} of"
                        f" {gbps(nbytes, ref_get):6.2f}",
                        flush=True,
                    )
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"total {args.total_mib} MiB per run; refs: memcpy (cpu/gpu), one file write+fdatasync "
        "and one sequential read (disk)"
    )


if __name__ == "__main__":
    main()
