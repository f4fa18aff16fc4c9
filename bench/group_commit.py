"""How to make many blocks durable per fsync: the disk tier's layouts, against ``dd``.

Each round writes the same ``--blocks`` blocks of ``--size`` bytes into a fresh folder of the
data directory's filesystem, four ways, and prints each one's throughput over the reference's:

- ``dd``: the blocks' bytes to one file, one ``fdatasync`` (``dd ... conv=fdatasync``): the
  floor no durable layout beats;
- ``file_each``: one file per block, each ``fdatasync``-ed, renamed and its folder ``fsync``-ed
  before the next (the disk tier's ``put`` until now);
- ``file_batch``: one file per block, all written with their write-back started, then each
  ``fdatasync``-ed, all renamed, and each shard folder ``fsync``-ed once per batch of
  ``--batch`` blocks (``DiskTier.put_many``);
- ``segment``: blocks appended to one segment file per batch, one ``fdatasync`` and one
  folder ``fsync`` per batch (a log-structured layout).

Run: ``python -m bench.group_commit [--dir DATA_DIR] [--rounds 5] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from sessioncache.tiers.fileio import fsync_dir, sync_file_range, write_all, write_with_writeback

FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


def _write(fd: int, data: memoryview) -> None:
    if sync_file_range is not None:
        write_with_writeback(fd, data[:0], data, sync_file_range)
    else:
        write_all(fd, [data])


def dd(root: Path, blocks: list[memoryview], batch: int) -> None:
    fd = os.open(root / "dd.bin", FLAGS, 0o644)
    try:
        for b in blocks:
            _write(fd, b)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _shard(root: Path, i: int) -> Path:
    hexid = secrets.token_hex(16)
    shard = root / hexid[0:2] / hexid[2:4]
    shard.mkdir(parents=True, exist_ok=True)
    return shard / hexid


def file_each(root: Path, blocks: list[memoryview], batch: int) -> None:
    for i, b in enumerate(blocks):
        final = _shard(root, i)
        tmp = final.with_suffix(".tmp")
        fd = os.open(tmp, FLAGS, 0o644)
        try:
            _write(fd, b)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final.with_suffix(".blk"))
        fsync_dir(str(final.parent))


def file_batch(root: Path, blocks: list[memoryview], batch: int) -> None:
    for first in range(0, len(blocks), batch):
        open_files: list[tuple[int, Path]] = []
        for i, b in enumerate(blocks[first : first + batch], first):
            final = _shard(root, i)
            tmp = final.with_suffix(".tmp")
            fd = os.open(tmp, FLAGS, 0o644)
            _write(fd, b)
            open_files.append((fd, final))
        for fd, _ in open_files:
            os.fdatasync(fd)
            os.close(fd)
        for _, final in open_files:
            os.rename(final.with_suffix(".tmp"), final.with_suffix(".blk"))
        for shard in {str(final.parent) for _, final in open_files}:
            fsync_dir(shard)


def segment(root: Path, blocks: list[memoryview], batch: int) -> None:
    for first in range(0, len(blocks), batch):
        fd = os.open(root / f"segment-{first}.seg", FLAGS, 0o644)
        try:
            for b in blocks[first : first + batch]:
                _write(fd, b)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        fsync_dir(str(root))


CASES: dict[str, Callable[[Path, list[memoryview], int], None]] = {
    "dd": dd,
    "file_each": file_each,
    "file_batch": file_batch,
    "segment": segment,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="a folder on the data's filesystem")
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--size", type=int, default=2 << 20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    blocks = [
        memoryview(rng.integers(0, 256, args.size, dtype=np.uint8).tobytes())
        for _ in range(args.blocks)
    ]
    total = args.blocks * args.size
    times: dict[str, list[float]] = {name: [] for name in CASES}
    base = Path(tempfile.mkdtemp(prefix="group-commit-", dir=args.dir))
    try:
        for _ in range(args.rounds):
            for name, case in CASES.items():
                root = base / name
                root.mkdir()
                t0 = time.perf_counter()
                case(root, blocks, args.batch)
                times[name].append(time.perf_counter() - t0)
                shutil.rmtree(root)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    best = {name: min(t) for name, t in times.items()}
    print(
        f"{args.blocks} blocks of {args.size >> 10} KiB, batches of {args.batch}, "
        f"best of {args.rounds}"
    )
    print(f"{'case':<12}{'GB/s':>8}{'median GB/s':>13}{'over dd':>9}")
    out: dict[str, float] = {}
    for name in CASES:
        gbs = total / best[name] / 1e9
        med = total / statistics.median(times[name]) / 1e9
        ratio = best["dd"] / best[name]
        out[f"{name}.gbs"] = gbs
        out[f"{name}.over_dd"] = ratio
        print(f"{name:<12}{gbs:>8.2f}{med:>13.2f}{ratio:>9.2f}")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
