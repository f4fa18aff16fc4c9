"""LMCache's own L2 benchmark (``lmcache bench l2``) on ``SessionCacheL2`` and on LMCache's
``resp`` (Redis) and ``fs`` (filesystem) adapters, in the same run, with the same key count and
payload sizes: store and load GB/s, and ours over theirs.

Everything runs on this host, and every run on a fresh backend: a new ``sessioncache serve``
(CPU tier in shared memory, no disk tier), a new private ``redis-server`` (no persistence) for
``resp``, an empty temporary directory for ``fs``; so each grows its memory from nothing (a
Redis emptied by FLUSHALL would reuse memory its allocator had already faulted in). Ours runs
twice: through shared memory (``data_path`` ``same_host``, what an LMCache server next to the
node gets) and over the block stream (``stream``, what a remote one gets, here over
loopback).

Run: ``python -m bench.lmcache_l2 [--keys 64] [--sizes-kb 256 2048] [--rounds 5] [--json]``.
Needs the ``lmcache`` extra (``pip install '.[lmcache]'``) and ``redis-server`` on the PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.lookup import start

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20  # lmcache's "MB/s" is MiB/s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen(
        [
            "redis-server",
            *("--port", str(port), "--bind", "127.0.0.1", "--save", ""),
            *("--appendonly", "no", "--dir", str(workdir)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("redis-server did not start")


class Backend:
    """The store one run benchmarks, started fresh, and the ``--l2-adapter`` JSON naming it."""

    def __init__(self, name: str, work: Path, size_kb: int, *, cpu_bytes: int) -> None:
        self.name = name
        self.dir = work / f"{name.split()[1]}-{size_kb}k"
        self.cpu_bytes = cpu_bytes
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> dict[str, Any]:
        if self.name.startswith("sessioncache"):
            self.process, url = start(self.dir, cpu_bytes=self.cpu_bytes)
            path = self.name.split()[1]
            return {
                "type": "native_plugin",
                "module_path": "sessioncache.connector.lmcache",
                "class_name": "SessionCacheL2",
                "adapter_params": {"url": url, "data_path": path, "kv_layout": "bench"},
            }
        self.dir.mkdir(parents=True)
        if "resp" in self.name:
            self.process, port = start_redis(self.dir)
            return {"type": "resp", "host": "127.0.0.1", "port": port}
        return {"type": "fs", "base_path": str(self.dir)}

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)


def lmcache_bench(spec: dict[str, Any], keys: int, size_kb: int, rounds: int, out: Path) -> dict:
    """One ``lmcache bench l2`` run; its JSON result's ``metrics``."""
    env = {
        **os.environ,
        "LMCACHE_DISABLE_BANNER": "1",
        "LMCACHE_TRACK_USAGE": "false",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [
            sys.executable,
            *("-c", "from lmcache.cli.main import main; main()"),
            *("bench", "l2", "--l2-adapter", json.dumps(spec)),
            *("--num-keys", str(keys), "--data-size-kb", str(size_kb)),
            *("--rounds", str(rounds), "--warmup-rounds", "1", "--no-skip-verify"),
            *("--format", "json", "--output", str(out), "-q"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if run.returncode != 0 or not out.exists():
        raise RuntimeError(f"lmcache bench l2 failed for {spec['type']}:\n{run.stderr[-4000:]}")
    metrics: dict[str, Any] = json.loads(out.read_text())["metrics"]
    return metrics


def rates(metrics: dict[str, Any]) -> dict[str, float]:
    """Store and load GB/s of the best measured round and averaged over them (LMCache's own
    figures); every key must have made it. The best round is the one least disturbed by the
    other processes of a shared machine; the ratios use it."""
    got: dict[str, float] = {}
    for op in (v for k, v in metrics.items() if k.startswith("op_")):
        name = str(op["operation"]).lower()
        if name in ("store", "load"):
            if op["total_success"] != op["total_keys"]:
                raise RuntimeError(f"{name}: {op['total_success']} of {op['total_keys']} keys")
            got[name] = op["throughput_max_mbps"] * MB / 1e9
            got[f"{name}_avg"] = op["throughput_avg_mbps"] * MB / 1e9
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=64, help="keys per submit")
    parser.add_argument("--sizes-kb", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per operation")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-lmcache-l2-"))
    per_run = args.keys * (args.rounds + 1) * max(args.sizes_kb) * 1024
    results: dict[str, dict[str, dict[str, float]]] = {}
    names = ("sessioncache same_host", "sessioncache stream", "lmcache resp (redis)", "lmcache fs")
    try:
        for size_kb in args.sizes_kb:
            results[f"{size_kb}k"] = {}
            for name in names:
                # Every run starts on a fresh backend (a new node, a new redis-server, an empty
                # directory): each then grows its memory from nothing, as the others do.
                with Backend(name, work, size_kb, cpu_bytes=max(1 << 30, 2 * per_run)) as spec:
                    out = work / f"{size_kb}-{names.index(name)}.json"
                    metrics = lmcache_bench(spec, args.keys, size_kb, args.rounds, out)
                results[f"{size_kb}k"][name] = rates(metrics)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"lmcache bench l2, {args.keys} keys per submit, GB/s of the best of {args.rounds} "
        "rounds (average in parentheses); ratios of the best rounds"
    )
    header = ("size", "adapter", "store", "(avg)", "load", "(avg)", "store/resp", "load/resp")
    print("{:>6} {:<24} {:>6} {:>7} {:>6} {:>7} {:>11} {:>10}".format(*header))
    for size, by_name in results.items():
        resp = by_name["lmcache resp (redis)"]
        for name, got in by_name.items():
            print(
                f"{size:>6} {name:<24} {got['store']:6.2f} ({got['store_avg']:5.2f}) "
                f"{got['load']:6.2f} ({got['load_avg']:5.2f}) "
                f"{got['store'] / resp['store']:10.2f}x {got['load'] / resp['load']:9.2f}x"
            )
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
