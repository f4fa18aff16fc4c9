"""Load: many concurrent clients replaying agent sessions against one real node.

``python -m bench.load`` starts ``sessioncache serve`` on a free port (its own data dir, the
capacities given), then runs ``--clients`` client threads for ``--seconds``; client ``i``
replays agent session ``i mod n`` of ``--traces`` (the agentic coding sessions of
``/work/shared/traces/agent-sessions``: 64-token blocks, ids local to a session) over path
``i mod len(--paths)`` (REST, the stream, same-host shared memory). Each request of a session:
look up its prompt, load the matched blocks (checking every byte), store the rest. No think
time: the sessions run back to back, which is the load, not the traces' pacing.

Prints throughput, p50 and p99 per path and operation, the error count (it must be 0), and the
node's peak RSS (``VmHWM``) against its configured CPU capacity. The reference is the same
replay with one client, measured first in the same run: the table's ratio is the p50 at
``--clients`` over the p50 alone (the cost of sharing the node).

Payloads are ``--block-kib`` per 64-token block (real KV of an 8B model is 8 MiB; the figures
are for the control and data paths, not for memory bandwidth) and prompts are cut at
``--max-blocks``. The client threads share one Python process: on a small machine they, not
the node, can be the bottleneck (the table says how busy the node's process was).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import xxhash

from bench.lookup import free_port
from sessioncache.connector import StreamClient, discover
from sessioncache.connector.samehost import SameHostClient
from sessioncache.hashing import Namespace

TRACES = Path("/work/shared/traces/agent-sessions")
BLOCK_TOKENS = 64
NS = Namespace("load-model", block_tokens=BLOCK_TOKENS, kv_dtype="bf16", kv_layout="x")
NS_JSON = {"model": NS.model, "block_tokens": BLOCK_TOKENS, "kv_dtype": "bf16", "kv_layout": "x"}


def sessions(folder: Path, max_blocks: int) -> list[list[list[int]]]:
    """Per session, its requests' hash-id lists in order (subagent requests inline)."""

    def flat(requests: list[dict[str, Any]]) -> Iterator[list[int]]:
        for r in requests:
            if r.get("type") == "subagent":
                yield from flat(r.get("requests", []))
            elif r.get("hash_ids"):
                yield [int(h) for h in r["hash_ids"][:max_blocks]]

    out = []
    for path in sorted(folder.glob("*.json")):
        reqs = list(flat(json.loads(path.read_text())["requests"]))
        if reqs:
            out.append(reqs)
    if not out:
        raise SystemExit(f"no agent sessions in {folder}")
    return out


_TOKENS: dict[tuple[int, int], np.ndarray] = {}


def block_tokens(session: int, hash_id: int) -> np.ndarray:
    """The 64 tokens of a trace block: a function of (session, id), so equal ids are equal
    prefixes and sessions never share blocks (their ids are local)."""
    key = (session, hash_id)
    found = _TOKENS.get(key)
    if found is None:
        seed = xxhash.xxh64_intdigest(f"{session}:{hash_id}".encode())
        found = np.random.default_rng(seed).integers(0, 100_000, BLOCK_TOKENS).astype(np.uint32)
        _TOKENS[key] = found
    return found


def payload(block_id: bytes, size: int) -> bytes:
    return (block_id * (size // 16 + 1))[:size]


class Client(threading.Thread):
    def __init__(
        self, path: str, url: str, session: int, requests: list[list[int]], args: Any
    ) -> None:
        super().__init__(daemon=True)
        self.path, self.url, self.session, self.requests = path, url, session, requests
        self.block = args.block_kib << 10
        self.stop_at = 0.0
        self.lat: dict[str, list[float]] = defaultdict(list)
        self.errors: list[str] = []
        self.blocks_moved = 0

    def tokens(self, hash_ids: list[int]) -> np.ndarray:
        return np.concatenate([block_tokens(self.session, h) for h in hash_ids])

    def run(self) -> None:
        try:
            if self.path == "rest":
                with httpx.Client(base_url=self.url, timeout=60) as http:
                    self.loop(lambda toks: self.rest_request(http, toks))
            else:
                if self.path == "stream":
                    client: StreamClient = StreamClient.connect(discover(self.url), timeout=60)
                else:
                    where = httpx.get(f"{self.url}/v1/dataplane").json()["same_host"]
                    client = SameHostClient.connect(where, timeout=60)
                with client:
                    root = client.resolve(NS)
                    self.loop(lambda toks: self.stream_request(client, root, toks))
        except Exception as exc:
            self.errors.append(f"{self.path}: {exc!r}")

    def loop(self, one: Any) -> None:
        i = 0
        while time.perf_counter() < self.stop_at:
            hash_ids = self.requests[i % len(self.requests)]
            i += 1
            try:
                one(self.tokens(hash_ids))
            except Exception as exc:
                self.errors.append(f"{self.path}: {exc!r}")
                if len(self.errors) > 20:
                    return

    def timed(self, op: str, start: float) -> None:
        self.lat[op].append(time.perf_counter() - start)

    def rest_request(self, http: httpx.Client, toks: np.ndarray) -> None:
        t = time.perf_counter()
        found = http.post("/v1/lookup", json={"namespace": NS_JSON, "tokens": toks.tolist()})
        found.raise_for_status()
        self.timed("lookup", t)
        hashes = [b["hash"] for b in found.json()["blocks"]]
        if hashes:
            t = time.perf_counter()
            for h in hashes[:8]:  # a REST engine reads by id; a sample keeps the mix balanced
                r = http.get(f"/v1/blocks/{h}")
                r.raise_for_status()
                if r.content != payload(bytes.fromhex(h), self.block):
                    raise AssertionError(f"wrong payload for {h}")
                self.blocks_moved += 1
            self.timed("load", t)
        t = time.perf_counter()
        plan = http.post("/v1/store", json={"namespace": NS_JSON, "tokens": toks.tolist()})
        plan.raise_for_status()
        missing = plan.json()["missing"]
        for h in missing:
            r = http.put(f"/v1/blocks/{h}", content=payload(bytes.fromhex(h), self.block))
            r.raise_for_status()
            self.blocks_moved += 1
        self.timed("store", t)

    def stream_request(self, client: StreamClient, root: bytes, toks: np.ndarray) -> None:
        ids = client.block_hashes(root, toks)
        t = time.perf_counter()
        found = client.lookup(root, ids)
        self.timed("lookup", t)
        n = found.matched
        if n:
            t = time.perf_counter()
            got = client.load(ids[:n])
            for bid, data in zip(ids[:n], got, strict=True):
                # evicted between the lookup and the load: a miss, not an error
                if data is not None and bytes(data) != payload(bid, self.block):
                    raise AssertionError(f"wrong payload for {bid.hex()}")
            self.blocks_moved += n
            self.timed("load", t)
        if n < len(ids):
            t = time.perf_counter()
            rest = toks[n * BLOCK_TOKENS :]
            blobs = [np.frombuffer(payload(b, self.block), np.uint8) for b in ids[n:]]
            client.store(root, rest, blobs, parent=ids[n - 1] if n else None)
            self.blocks_moved += len(ids) - n
            self.timed("store", t)


def start_node(args: Any, data: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {
        **os.environ,
        "SESSIONCACHE_CPU_BYTES": str(args.cpu_mib << 20),
        "SESSIONCACHE_DISK_BYTES": str(args.disk_mib << 20),
        "SESSIONCACHE_STREAM_PORT": "0",
        "SESSIONCACHE_STREAM_MAX_CONNECTIONS": str(max(64, args.clients * 2)),
        "SESSIONCACHE_DURABLE_UPLOADS": "false",
    }
    log = (data.parent / "serve.log").open("wb")
    cmd = [sys.executable, "-m", "sessioncache.cli", "serve", "--port", str(port)]
    process = subprocess.Popen(
        [*cmd, "--data-dir", str(data)], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the node exited: {(data.parent / 'serve.log').read_text()}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit("the node did not start")


def proc_figures(pid: int) -> tuple[int, float]:
    """Peak RSS in bytes and CPU seconds used so far of process ``pid``."""
    hwm = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) << 10
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return hwm, cpu


def run_phase(
    url: str, clients: int, paths: list[str], traces: list[list[list[int]]], args: Any
) -> list[Client]:
    workers = [
        Client(paths[i % len(paths)], url, i % len(traces), traces[i % len(traces)], args)
        for i in range(clients)
    ]
    stop_at = time.perf_counter() + args.seconds
    for w in workers:
        w.stop_at = stop_at
        w.start()
    for w in workers:
        w.join(args.seconds + 120)
    return workers


def summarize(workers: list[Client], seconds: float) -> dict[tuple[str, str], dict[str, float]]:
    lat: dict[tuple[str, str], list[float]] = defaultdict(list)
    for w in workers:
        for op, values in w.lat.items():
            lat[(w.path, op)] += values
    out = {}
    for key, values in sorted(lat.items()):
        arr = np.asarray(values) * 1000
        out[key] = {
            "count": len(arr),
            "per_s": len(arr) / seconds,
            "p50_ms": float(np.percentile(arr, 50)),
            "p99_ms": float(np.percentile(arr, 99)),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--paths", default="rest,stream,same_host")
    parser.add_argument("--traces", type=Path, default=TRACES)
    parser.add_argument("--sessions", type=int, default=0, help="use the first N (0: all)")
    parser.add_argument("--block-kib", type=int, default=16)
    parser.add_argument("--max-blocks", type=int, default=64)
    parser.add_argument("--cpu-mib", type=int, default=512)
    parser.add_argument("--disk-mib", type=int, default=2048)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    paths = args.paths.split(",")
    traces = sessions(args.traces, args.max_blocks)
    if args.sessions:
        traces = traces[: args.sessions]
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        process, url = start_node(args, Path(tmp) / "data")
        try:
            solo = run_phase(url, len(paths), paths, traces, args)  # the reference
            solo_stats = summarize(solo, args.seconds)
            cpu_before = proc_figures(process.pid)[1]
            workers = run_phase(url, args.clients, paths, traces, args)
            peak, cpu_after = proc_figures(process.pid)
            stats = summarize(workers, args.seconds)
        finally:
            process.terminate()
            process.wait(30)
    errors = [e for w in solo + workers for e in w.errors]
    moved = sum(w.blocks_moved for w in workers)
    print(
        f"{args.clients} clients, {args.seconds:.0f} s, paths {','.join(paths)}, "
        f"{len(traces)} agent sessions, {args.block_kib} KiB blocks, "
        f"cpu tier {args.cpu_mib} MiB"
    )
    print(
        f"{'path':10} {'op':7} {'count':>7} {'per s':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'p50 alone':>9} {'ratio':>6}"
    )
    for (path, op), s in stats.items():
        alone = solo_stats.get((path, op), {}).get("p50_ms", float("nan"))
        print(
            f"{path:10} {op:7} {s['count']:7d} {s['per_s']:8.1f} {s['p50_ms']:8.2f} "
            f"{s['p99_ms']:8.2f} {alone:9.2f} {s['p50_ms'] / alone:6.1f}"
        )
    node_cpu = (cpu_after - cpu_before) / args.seconds
    print(
        f"blocks moved {moved} ({moved / args.seconds:.0f}/s); node busy {node_cpu:.2f} cores; "
        f"errors {len(errors)}"
    )
    cap = args.cpu_mib << 20
    print(
        f"node peak RSS {peak / 2**20:.0f} MiB = cpu tier {args.cpu_mib} MiB + "
        f"{(peak - cap) / 2**20:.0f} MiB overhead (ratio to capacity {peak / cap:.2f})"
    )
    for e in errors[:10]:
        print("error:", e)
    if args.json:
        print(
            json.dumps(
                {
                    "ops": {f"{p}/{o}": s for (p, o), s in stats.items()},
                    "errors": len(errors),
                    "peak_rss_bytes": peak,
                    "cpu_capacity_bytes": cap,
                }
            )
        )
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
