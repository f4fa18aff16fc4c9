"""Lookup latency over loopback: p50/p99 for 8K / 32K / 128K-token prompts, 1 / 8 / 32
concurrent clients, JSON tokens vs binary (``tokens_b64``) tokens.

A real ``sessioncache serve`` process is started on a free port (CPU tier only) and every
prompt's chain is stored first, so each lookup matches the whole prompt. Request bodies are
encoded once up front and each client is its own process: the figures are the server's and
the loopback's, not the client's JSON encoder; clients and server share this machine's two
cores. The reference printed beside them is the same number of empty ``GET /healthz`` round
trips at the same concurrency (the HTTP floor of this machine).

Run: ``python -m bench.lookup [--requests 200] [--block-tokens 16] [--tokens 8192 32768 131072]
[--clients 1 8 32]``.
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

PROMPTS = [8192, 32768, 131072]
CONCURRENCY = [1, 8, 32]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(data_dir: Path, cpu_bytes: int = 1 << 30) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {
        **os.environ,
        "SESSIONCACHE_CPU_BYTES": str(cpu_bytes),
        "SESSIONCACHE_DISK_BYTES": "0",
        "SESSIONCACHE_DURABLE_UPLOADS": "false",
        "SESSIONCACHE_STREAM_PORT": "0",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sessioncache.cli",
            "serve",
            "--port",
            str(port),
            "--data-dir",
            str(data_dir),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/healthz").status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not start")


def _client(job: tuple[str, str, bytes | None, int]) -> list[float]:
    url, path, body, count = job
    out = []
    with httpx.Client(base_url=url, timeout=60) as c:
        for _ in range(count):
            start = time.perf_counter()
            if body is None:
                r = c.get(path)
            else:
                r = c.post(path, content=body, headers={"content-type": "application/json"})
            r.read()
            out.append(time.perf_counter() - start)
            assert r.status_code == 200, r.text
    return out


def run(url: str, path: str, body: bytes | None, clients: int, per_client: int) -> list[float]:
    """Latencies of ``clients`` concurrent closed-loop clients, each its own process (client
    threads in one process would contend for one GIL and measure the client)."""
    with multiprocessing.get_context("fork").Pool(clients) as pool:
        results = pool.map(_client, [(url, path, body, per_client)] * clients)
    return [t for r in results for t in r]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, q))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200, help="per configuration")
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--tokens", type=int, nargs="+", default=PROMPTS, help="prompt lengths")
    parser.add_argument(
        "--clients", type=int, nargs="+", default=CONCURRENCY, help="concurrent clients"
    )
    args = parser.parse_args()
    ns = {
        "model": "bench",
        "block_tokens": args.block_tokens,
        "kv_dtype": "bf16",
        "kv_layout": "bench",
    }
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start(Path(tmp) / "data")
        try:
            rng = np.random.default_rng(0)
            bodies: dict[tuple[int, str], bytes] = {}
            with httpx.Client(base_url=url, timeout=120) as c:
                for n in args.tokens:
                    toks = rng.integers(0, 128_000, n, dtype=np.uint32)
                    plan = c.post("/v1/store", json={"namespace": ns, "tokens": toks.tolist()})
                    for h in plan.json()["missing"]:
                        c.put(f"/v1/blocks/{h}", content=b"\0" * 64)
                    bodies[(n, "json")] = json.dumps(
                        {"namespace": ns, "tokens": toks.tolist()}
                    ).encode()
                    bodies[(n, "binary")] = json.dumps(
                        {
                            "namespace": ns,
                            "tokens_b64": base64.b64encode(toks.astype("<u4").tobytes()).decode(),
                        }
                    ).encode()
                    check = c.post(
                        "/v1/lookup",
                        content=bodies[(n, "binary")],
                        headers={"content-type": "application/json"},
                    ).json()
                    assert check["matched_tokens"] == n // args.block_tokens * args.block_tokens
            print(
                f"{'tokens':>7} {'form':>6} {'clients':>7} {'p50 ms':>8} {'p99 ms':>8} "
                f"{'healthz p50':>11} {'p99':>7}"
            )
            for clients in args.clients:
                per_client = max(1, args.requests // clients)
                floor = run(url, "/healthz", None, clients, per_client)
                for n in args.tokens:
                    for form in ("json", "binary"):
                        lat = run(url, "/v1/lookup", bodies[(n, form)], clients, per_client)
                        print(
                            f"{n:>7} {form:>6} {clients:>7} {pct(lat, 50):8.2f} "
                            f"{pct(lat, 99):8.2f} {pct(floor, 50):11.2f} {pct(floor, 99):7.2f}",
                            flush=True,
                        )
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
