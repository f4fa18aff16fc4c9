"""LMCache's own L2 benchmark (``lmcache bench l2``) on ``SessionCacheL2`` and on LMCache's
``resp`` (Redis) and ``fs`` (filesystem) adapters, in the same run, with the same key count and
payload sizes: store and load GB/s, and ours over theirs.

Everything runs on this host, in two regimes, each on fresh backends (a new
``sessioncache serve`` as README starts it: its CPU tier in shared memory, its disk tier on,
stores written behind to it; with ``--stripped``, labelled, one without the disk tier; a new
private
``redis-server`` without persistence, an empty temporary directory for ``fs``):

- ``fresh``: each backend grows its memory from nothing during the run, as a node or a Redis
  does in its first minutes: the node makes new 64 MiB memfd segments (ahead of need, in the
  background: ``SESSIONCACHE_CPU_SPARE_CHUNKS``), Redis's allocator faults in new pages;
- ``warm``: each backend is as it is once it has run a while: the node's tier made
  (``SESSIONCACHE_CPU_PREALLOCATE=true``; a full tier reuses the slots it evicts), Redis full
  (filled with as many bytes as the run stores, in values with a TTL, under a ``maxmemory``
  just above them with ``volatile-lru``: each value the run stores evicts a filler value, and
  the allocator may reuse its memory; see ``warm_redis``). ``fs`` is not run warm (the page
  cache is the kernel's either way).

Ours runs twice per regime: through shared memory (``data_path`` ``same_host``, what an
LMCache server next to the node gets) and over the block stream (``stream``, what a remote
one gets, here over loopback). Ratios compare ours to ``resp`` in the same regime. Each
backend is stopped, its files removed and synced before the next starts, so that none runs
during another's writeback.

Run: ``python -m bench.lmcache_l2 [--keys 64] [--sizes-kb 256 2048] [--rounds 5]
[--regimes fresh warm] [--json]``. Needs the ``lmcache`` extra (``pip install '.[lmcache]'``)
and ``redis-server`` on the PATH.
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

from bench.lookup import free_port, start

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20  # lmcache's "MB/s" is MiB/s


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


STRIPPED = False
"""Run the node without its disk tier (``--stripped``)."""


class Backend:
    """The store one run benchmarks, started fresh, and the ``--l2-adapter`` JSON naming it.
    ``name`` is ``sessioncache same_host``, ``sessioncache stream``, ``lmcache resp (redis)``
    or ``lmcache fs``; ``warm``: its memory made before the run (module docstring)."""

    def __init__(
        self,
        name: str,
        work: Path,
        size_kb: int,
        *,
        cpu_bytes: int,
        warm: bool,
        fill: int,
        margin: int,
    ) -> None:
        self.name = name
        self.warm = warm
        self.size = size_kb * 1024
        self.fill = fill
        self.margin = margin
        self.dir = work / f"{name.split()[1]}-{size_kb}k{'-warm' if warm else ''}"
        self.cpu_bytes = cpu_bytes
        self.process: subprocess.Popen[bytes] | None = None
        self.note = ""

    def __enter__(self) -> dict[str, Any]:
        if self.name.startswith("sessioncache"):
            env = {"SESSIONCACHE_CPU_PREALLOCATE": "true"} if self.warm else {}
            if not STRIPPED:
                env["SESSIONCACHE_DISK_BYTES"] = str(64 << 30)  # README's node
            self.process, url = start(self.dir, cpu_bytes=self.cpu_bytes, extra_env=env)
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
            if self.warm:
                self.note = warm_redis(port, self.fill, self.size, self.margin)
            return {"type": "resp", "host": "127.0.0.1", "port": port}
        return {"type": "fs", "base_path": str(self.dir)}

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)
        # its files' writeback done here, not during the next backend's run
        os.sync()


def warm_redis(port: int, nbytes: int, size: int, margin: int) -> str:
    """Make Redis full, as it is once it has run a while: ``nbytes`` of filler values of
    ``size`` bytes, each with a TTL, and ``maxmemory`` ``margin`` above what they take with the
    ``volatile-lru`` policy, so that every value the run stores evicts a filler value (and
    only those: the run's keys have no TTL) and the allocator may reuse its memory. (Emptying
    Redis instead does not keep it warm: FLUSHALL purges large values' pages, measured.)
    Returns what it did, for the record."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    value = b"\xa5" * size
    count = nbytes // size
    for first in range(0, count, 16):
        pipe = client.pipeline(transaction=False)
        for i in range(first, min(first + 16, count)):
            pipe.set(f"warm:{i}", value, ex=24 * 3600)
        pipe.execute()
    used = int(client.info("memory")["used_memory"])
    # The margin leaves room for the client's pipelined query buffers (they count as used
    # memory): without it Redis evicts every filler value at once and then refuses writes.
    limit = used + margin
    client.config_set("maxmemory-policy", "volatile-lru")
    client.config_set("maxmemory", str(limit))
    rss = int(client.info("memory")["used_memory_rss"])
    client.close()
    return (
        f"redis full: {count} filler values, maxmemory {limit / MB:.0f} MiB, RSS {rss / MB:.0f} MiB"
    )


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


NAMES = ("sessioncache same_host", "sessioncache stream", "lmcache resp (redis)", "lmcache fs")
RESP = "lmcache resp (redis)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=64, help="keys per submit")
    parser.add_argument("--sizes-kb", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per operation")
    parser.add_argument(
        "--regimes", nargs="+", choices=["fresh", "warm"], default=["fresh", "warm"]
    )
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    parser.add_argument(
        "--stripped", action="store_true", help="a node without its disk tier (not README's)"
    )
    args = parser.parse_args()
    global STRIPPED
    STRIPPED = args.stripped
    print("node:", "stripped (no disk tier)" if STRIPPED else "README's (disk tier on)")

    work = Path(tempfile.mkdtemp(prefix="bench-lmcache-l2-"))
    per_run = args.keys * (args.rounds + 1) * max(args.sizes_kb) * 1024
    results: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    notes: list[str] = []
    try:
        for size_kb in args.sizes_kb:
            results[f"{size_kb}k"] = {}
            for regime in args.regimes:
                got = results[f"{size_kb}k"][regime] = {}
                warm = regime == "warm"
                for name in NAMES:
                    if warm and name == "lmcache fs":
                        continue
                    fill = args.keys * (args.rounds + 1) * size_kb * 1024
                    backend = Backend(
                        name,
                        work,
                        size_kb,
                        cpu_bytes=max(1 << 30, 2 * per_run),
                        warm=warm,
                        fill=fill,
                        margin=2 * args.keys * size_kb * 1024 + (16 << 20),
                    )
                    with backend as spec:
                        out = work / f"{size_kb}-{regime}-{NAMES.index(name)}.json"
                        metrics = lmcache_bench(spec, args.keys, size_kb, args.rounds, out)
                    if backend.note:
                        notes.append(f"{size_kb}k {regime}: {backend.note}")
                    got[name] = rates(metrics)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"lmcache bench l2, {args.keys} keys per submit, GB/s of the best of {args.rounds} "
        "rounds (average in parentheses); ratios of the best rounds, over resp in the same "
        "regime"
    )
    header = ("size", "regime", "adapter", "store", "(avg)", "load", "(avg)", "store/resp")
    print("{:>6} {:<6} {:<24} {:>6} {:>7} {:>6} {:>7} {:>11} load/resp".format(*header))
    for size, by_regime in results.items():
        for regime, by_name in by_regime.items():
            resp = by_name[RESP]
            for name, got in by_name.items():
                print(
                    f"{size:>6} {regime:<6} {name:<24} {got['store']:6.2f} "
                    f"({got['store_avg']:5.2f}) {got['load']:6.2f} ({got['load_avg']:5.2f}) "
                    f"{got['store'] / resp['store']:10.2f}x {got['load'] / resp['load']:9.2f}x"
                )
    for note in notes:
        print(note)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
