"""LMCache's own L2 benchmark (``lmcache bench l2``) on ``SessionCacheL2`` and on LMCache's
``resp`` (Redis) and ``fs`` (filesystem) adapters, in the same run, with the same key count and
payload sizes: store and load GB/s, and ours over theirs.

Everything runs on this host: a ``sessioncache serve`` (CPU tier in shared memory, no disk
tier), a private ``redis-server`` (no persistence) for ``resp``, a temporary directory for
``fs``. Ours runs twice: through shared memory (``data_path`` ``same_host``, what an LMCache
server next to the node gets) and over the block stream (``stream``, what a remote one gets,
here over loopback). Each run stores under its own namespace (``kv_layout``), so that no run
finds the blocks of another.

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


def flush_redis(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"FLUSHALL\r\n")
        s.recv(16)


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


def rates(metrics: dict[str, Any], keys: int) -> dict[str, float]:
    """Store and load GB/s (LMCache's average over the measured rounds); every key must have
    made it."""
    got: dict[str, float] = {}
    for op in (v for k, v in metrics.items() if k.startswith("op_")):
        name = str(op["operation"]).lower()
        if name in ("store", "load"):
            if op["total_success"] != op["total_keys"]:
                raise RuntimeError(f"{name}: {op['total_success']} of {op['total_keys']} keys")
            got[name] = op["throughput_avg_mbps"] * MB / 1e9
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
    node, url = start(work / "node", cpu_bytes=max(1 << 30, 3 * per_run * len(args.sizes_kb)))
    redis_proc, redis_port = start_redis(work)
    results: dict[str, dict[str, dict[str, float]]] = {}
    try:
        for size_kb in args.sizes_kb:
            runs: dict[str, dict[str, Any]] = {
                "sessioncache same_host": {
                    "type": "native_plugin",
                    "module_path": "sessioncache.connector.lmcache",
                    "class_name": "SessionCacheL2",
                    "adapter_params": {
                        "url": url,
                        "data_path": "same_host",
                        "kv_layout": f"bench-same-host-{size_kb}k",
                    },
                },
                "sessioncache stream": {
                    "type": "native_plugin",
                    "module_path": "sessioncache.connector.lmcache",
                    "class_name": "SessionCacheL2",
                    "adapter_params": {
                        "url": url,
                        "data_path": "stream",
                        "kv_layout": f"bench-stream-{size_kb}k",
                    },
                },
                "lmcache resp (redis)": {"type": "resp", "host": "127.0.0.1", "port": redis_port},
                "lmcache fs": {"type": "fs", "base_path": str(work / f"fs-{size_kb}")},
            }
            results[f"{size_kb}k"] = {}
            for name, spec in runs.items():
                flush_redis(redis_port)
                metrics = lmcache_bench(
                    spec, args.keys, size_kb, args.rounds, work / f"{size_kb}-{len(results)}.json"
                )
                results[f"{size_kb}k"][name] = rates(metrics, args.keys)
                shutil.rmtree(work / f"fs-{size_kb}", ignore_errors=True)
                (work / f"{size_kb}-{len(results)}.json").unlink(missing_ok=True)
    finally:
        node.terminate()
        redis_proc.terminate()
        node.wait(30)
        redis_proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)

    print(f"lmcache bench l2, {args.keys} keys per submit, {args.rounds} rounds, GB/s")
    print(
        f"{'size':>6} {'adapter':<24} {'store':>7} {'load':>7} {'store/resp':>11} {'load/resp':>10}"
    )
    for size, by_name in results.items():
        resp = by_name["lmcache resp (redis)"]
        for name, got in by_name.items():
            print(
                f"{size:>6} {name:<24} {got['store']:7.2f} {got['load']:7.2f} "
                f"{got['store'] / resp['store']:10.2f}x {got['load'] / resp['load']:9.2f}x"
            )
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
