"""Block transfer over HTTP: PUT and GET throughput of 2 MiB blocks through a real
``sessioncache serve`` process (CPU tier, no disk write-through), single blocks and the batch
read, printed beside a raw redis-py SET/GET of the same bytes against the local Redis in the
same run (the reference: another network store of this machine over the same loopback).

Run: ``python -m bench.transfer [--blocks 128] [--redis redis://127.0.0.1:6379/0]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import redis

from bench.lookup import start

MiB = 1 << 20


def best(fn: object, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start_t = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start_t)
    return min(times)


def redis_set_get(url: str, n: int, payload: bytes) -> tuple[float, float]:
    """Best seconds of ``n`` raw redis-py ``SET``s, then ``GET``s, of ``payload``."""
    r = redis.Redis.from_url(url)
    prefix = f"bench-transfer-{uuid.uuid4().hex[:8]}:"
    keys = [f"{prefix}{i}" for i in range(n)]
    try:
        raw_set = best(lambda: [r.set(k, payload) for k in keys])
        raw_get = best(lambda: [r.get(k) for k in keys])
    finally:
        r.delete(*keys)
        r.close()
    return raw_set, raw_get


def http_transfers(c: httpx.Client, n: int, payload: bytes) -> dict[str, float]:
    """Best seconds of ``n`` block uploads (``put``), refused uploads (``floor``), single
    reads (``get``) and batch reads (``batch``) through the server behind ``c``, whose CPU
    tier holds ``n`` blocks."""
    size = len(payload)
    ns = {"model": "bench", "block_tokens": 16, "kv_dtype": "bf16", "kv_layout": "x"}
    puts: list[float] = []
    hashes: list[str] = []
    for rep in range(4):  # a fresh prompt each round: every block is missing
        toks = np.random.default_rng(rep).integers(0, 100_000, n * 16).tolist()
        plan = c.post("/v1/store", json={"namespace": ns, "tokens": toks}).json()
        missing = plan["missing"]
        start_t = time.perf_counter()
        for h in missing:
            c.put(
                f"/v1/blocks/{h}",
                content=payload,
                headers={"content-type": "application/octet-stream"},
            )
        puts.append(time.perf_counter() - start_t)
        hashes = plan["hashes"]
    out = {"put": min(puts[1:])}  # the first round faults the slabs in
    # The HTTP floor: the same bodies sent and read in full by the server, then refused (an
    # id not handed out): transport and body reading, no store.
    forged = "ab" * 16
    out["floor"] = best(lambda: [c.put(f"/v1/blocks/{forged}", content=payload) for _ in range(n)])
    out["get"] = best(lambda: [c.get(f"/v1/blocks/{h}").content for h in hashes])

    def batch() -> None:
        for i in range(0, n, 16):
            part = hashes[i : i + 16]
            r = c.post("/v1/blocks/batch", json={"hashes": part})
            assert len(r.content) > len(part) * size

    out["batch"] = best(batch)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--block-mib", type=int, default=2)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    size = args.block_mib * MiB
    n = args.blocks
    payload = np.random.default_rng(0).integers(0, 256, size, np.uint8).tobytes()
    total_gb = n * size / 1e9

    raw_set, raw_get = redis_set_get(args.redis, n, payload)
    with tempfile.TemporaryDirectory() as tmp:
        # A CPU tier of one round's blocks: later rounds evict the earlier ones and reuse
        # their slots, the steady state of a full cache (first touches of fresh memory cost
        # far more than the copy on this VM and are not what a running cache pays).
        proc, url = start(Path(tmp) / "data", cpu_bytes=n * size)
        try:
            with httpx.Client(base_url=url, timeout=120) as c:
                http = http_transfers(c, n, payload)
        finally:
            proc.terminate()
            proc.wait(10)

    def row(name: str, seconds: float, ref: float) -> str:
        return (
            f"{name:<28} {total_gb / seconds:6.2f} GB/s   {ref / seconds:6.1%} of raw Redis "
            f"({total_gb / ref:5.2f} GB/s)"
        )

    print(f"{n} blocks of {args.block_mib} MiB over loopback")
    print(row("HTTP PUT refused (floor)", http["floor"], raw_set))
    print(row("HTTP PUT /v1/blocks/{id}", http["put"], raw_set))
    print(row("HTTP GET /v1/blocks/{id}", http["get"], raw_get))
    print(row("HTTP POST /v1/blocks/batch", http["batch"], raw_get))


if __name__ == "__main__":
    main()
