"""Block copies on this machine, in the directions the tiers and the same-host path make them:
numpy ``copyto`` of 2 MiB blocks between ordinary (anonymous) memory and a memfd segment
mapped as the CPU tier maps its chunks (``MAP_SHARED | MAP_POPULATE``):

- anon -> anon:   the memcpy reference of the other benchmarks
- anon -> memfd:  a put into the CPU tier, a same-host store
- memfd -> anon:  a same-host load

glibc picks its copy strategy by size, and switches to non-temporal stores only above a
threshold derived from the cache size; ``GLIBC_TUNABLES`` changes it, but only at process
start. So the script measures the tunable by running itself in child processes, once with the
environment as it is and once under each ``--tunables`` value, rounds interleaved, best of
``--repeats`` per direction.

Run: ``python -m bench.memcpy [--blocks 512] [--block-mib 2] [--repeats 5]
[--tunables glibc.cpu.x86_non_temporal_threshold=0x100000]``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import time

import numpy as np

MiB = 1 << 20
DIRECTIONS = ("anon->anon", "anon->memfd", "memfd->anon")


def measure(blocks: int, size: int, repeats: int) -> dict[str, float]:
    """GB/s per direction, best of ``repeats`` rounds (in this process's environment)."""
    src = np.random.default_rng(0).integers(0, 256, (blocks, size), dtype=np.uint8)
    out = np.empty((blocks, size), np.uint8)
    out.fill(1)  # faulted in: the copies below measure copying, not page faults
    fd = os.memfd_create("bench-memcpy", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, blocks * size)
        memory = mmap.mmap(
            fd, blocks * size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        )
    finally:
        os.close(fd)
    shm = np.frombuffer(memory, np.uint8).reshape(blocks, size)
    shm[:] = src
    pairs = {"anon->anon": (src, out), "anon->memfd": (src, shm), "memfd->anon": (shm, out)}
    best: dict[str, float] = {}
    for _ in range(repeats):
        for name, (a, b) in pairs.items():
            t0 = time.perf_counter()
            for i in range(blocks):
                np.copyto(b[i], a[i])
            rate = blocks * size / (time.perf_counter() - t0) / 1e9
            best[name] = max(best.get(name, 0.0), rate)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--block-mib", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--tunables",
        nargs="*",
        default=["glibc.cpu.x86_non_temporal_threshold=0x100000"],
        help="GLIBC_TUNABLES values to compare with the environment as it is",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = int(args.block_mib * MiB)
    if args.child:
        print(json.dumps(measure(args.blocks, size, 1)))
        return
    base = os.environ.get("GLIBC_TUNABLES")
    settings: list[str | None] = [base, *args.tunables]
    results: list[dict[str, float]] = [{} for _ in settings]
    command = [sys.executable, "-m", "bench.memcpy", "--child", "--blocks", str(args.blocks)]
    command += ["--block-mib", str(args.block_mib)]
    for _ in range(args.repeats):  # interleaved: load from elsewhere hits every setting alike
        for i, value in enumerate(settings):
            env = dict(os.environ)
            if value is None:
                env.pop("GLIBC_TUNABLES", None)
            else:
                env["GLIBC_TUNABLES"] = value
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            for name, rate in json.loads(out.stdout.strip().splitlines()[-1]).items():
                results[i][name] = max(results[i].get(name, 0.0), rate)
    gb = args.blocks * size / 1e9
    print(f"{args.blocks} blocks of {args.block_mib:g} MiB ({gb:.2f} GB), best of {args.repeats}")
    print(f"{'GLIBC_TUNABLES':<48} " + " ".join(f"{d:>12}" for d in DIRECTIONS))
    for value, rates in zip(settings, results, strict=True):
        label = "(unset)" if value is None else repr(value)
        print(f"{label:<48} " + " ".join(f"{rates[d]:12.2f}" for d in DIRECTIONS))
    print("GB/s; memfd is the CPU tier's memory (the same-host path copies in and out of it)")


if __name__ == "__main__":
    main()
