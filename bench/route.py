"""KV-aware routing: KV events ingested per second and ``POST /v1/route`` latency.

A real ``sessioncache serve`` follows ``--engines`` simulated vLLM engines, each a ZMQ PUB
socket in this process publishing vLLM's messages (``(topic, seq, payload)``, the payload an
``EventBatch`` of ``BlockStored`` events in the >= 0.24 encoding, built and encoded before the
clock starts). Every engine caches prompts of ``--tokens`` tokens that share a 4K-token
system prompt, until ``--blocks`` blocks are indexed in all.

1. Ingest: from the first message sent until the node reports every engine's last sequence
   number (``GET /v1/engines``), in blocks per second. References in the same run, in this
   process: decoding the same payloads and applying them to an ``EngineIndex`` (the node's
   work without the sockets), and hashing their tokens alone (the floor of that work).
2. Route: ``--clients`` closed-loop client processes ask ``POST /v1/route`` for prompts each
   held whole by one engine (and their system prompt by all); bodies pre-encoded
   (``tokens_b64``, and ``block_ids_b64`` from ``POST /v1/namespaces/resolve``'s root).
   Reference: ``GET /healthz`` at the same concurrency, measured in the same run (the HTTP
   floor of this machine). The route's server CPU without HTTP is measured in process on the
   reference index: hashing the prompt plus ``EngineIndex.match``.

Run: ``python -m bench.route [--engines 16] [--blocks 1000000] [--tokens 32768]
[--clients 8] [--requests 200] [--json]``.
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import zmq

from bench.lookup import start as start_node
from sessioncache.hashing import Namespace, block_hashes_from_bytes
from sessioncache.routing.engine_index import EngineIndex
from sessioncache.routing.events import decode_batch

WEIGHTS = {"GPU": 1.0, "CPU": 0.5, "STORAGE": 0.25}
SYSTEM_TOKENS = 4096
BATCH_BLOCKS = 256
"""Blocks per BlockStored (vLLM sends one per request and step: a prefill chunk's blocks)."""


def start(data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    # engines idle between the ingest and the routes: never stale within a run
    env = {"SESSIONCACHE_ENGINE_STALE_S": "3600"}
    return start_node(data_dir, cpu_bytes=64 << 20, extra_env=env)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Workload:
    """Every engine's prompts and the encoded batches announcing them."""

    def __init__(self, engines: int, blocks: int, tokens: int, block_tokens: int) -> None:
        rng = np.random.default_rng(0)
        per_prompt = tokens // block_tokens
        sys_blocks = min(SYSTEM_TOKENS, tokens // 2) // block_tokens  # the rest per prompt
        system = rng.integers(0, 128_000, sys_blocks * block_tokens, dtype=np.uint32)
        enc = msgspec.msgpack.Encoder()
        self.prompts: list[list[np.ndarray[Any, Any]]] = []
        self.payloads: list[list[bytes]] = []
        self.blocks = 0
        hashes = iter(range(1, 1 << 62))
        per_engine = max(blocks // engines, per_prompt)
        for _e in range(engines):
            prompts: list[np.ndarray[Any, Any]] = []
            payloads: list[bytes] = []
            sys_hashes = [next(hashes) for _ in range(sys_blocks)]
            held = 0
            while held < per_engine:
                tail = rng.integers(0, 128_000, tokens - len(system), dtype=np.uint32)
                prompt = np.concatenate([system, tail])
                prompts.append(prompt)
                first = 0 if not payloads else sys_blocks  # the system prompt once per engine
                ids = sys_hashes + [next(hashes) for _ in range(per_prompt - sys_blocks)]
                for i in range(first, per_prompt, BATCH_BLOCKS):
                    j = min(i + BATCH_BLOCKS, per_prompt)
                    event = {
                        "type": "BlockStored",
                        "block_hashes": ids[i:j],
                        "parent_block_hash": ids[i - 1] if i else None,
                        "token_ids": prompt[i * block_tokens : j * block_tokens].tolist(),
                        "block_size": block_tokens,
                        "lora_id": None,
                        "medium": "GPU",
                        "lora_name": None,
                    }
                    payloads.append(enc.encode([time.time(), [event], 0]))
                    held += j - i
            self.blocks += held
            self.prompts.append(prompts)
            self.payloads.append(payloads)


def ingest_reference(work: Workload, block_tokens: int) -> tuple[float, float, EngineIndex]:
    """Blocks per second decoded and applied in process, and hashed alone."""
    root = Namespace("bench-route", block_tokens, "bf16", "x").root()
    index = EngineIndex()
    for e in range(len(work.payloads)):
        index.add(f"engine-{e}", block_tokens, lambda lora, keys: root)
    start = time.perf_counter()
    for e, payloads in enumerate(work.payloads):
        for payload in payloads:
            index.apply(f"engine-{e}", decode_batch(payload))
    applied = work.blocks / (time.perf_counter() - start)
    token_bytes = [p.astype("<u4").tobytes() for ps in work.prompts for p in ps]
    start = time.perf_counter()
    hashed = 0
    for tb in token_bytes:
        hashed += len(block_hashes_from_bytes(root, tb, block_tokens))
    return applied, hashed / (time.perf_counter() - start), index


def _client(job: tuple[str, str, list[bytes] | None, int]) -> list[float]:
    url, path, bodies, count = job
    out = []
    with httpx.Client(base_url=url, timeout=60) as c:
        for i in range(count):
            start = time.perf_counter()
            if bodies is None:
                r = c.get(path)
            else:
                body = bodies[i % len(bodies)]
                r = c.post(path, content=body, headers={"content-type": "application/json"})
            r.read()
            out.append(time.perf_counter() - start)
            assert r.status_code == 200, r.text
    return out


def run(url: str, path: str, bodies: list[bytes] | None, clients: int, n: int) -> list[float]:
    with multiprocessing.get_context("fork").Pool(clients) as pool:
        results = pool.map(_client, [(url, path, bodies, n)] * clients)
    return [t for r in results for t in r]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, q))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=1_000_000, help="indexed in all")
    parser.add_argument("--tokens", type=int, default=32768, help="per prompt")
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=200, help="per client")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args()
    bt = args.block_tokens
    ns = {"model": "bench-route", "block_tokens": bt, "kv_dtype": "bf16", "kv_layout": "x"}

    work = Workload(args.engines, args.blocks, args.tokens, bt)
    applied, hashed, index = ingest_reference(work, bt)

    ctx = zmq.Context()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start(Path(tmp) / "data")
        try:
            c = httpx.Client(base_url=url, timeout=120)
            pubs = []
            rss0 = rss_bytes(proc.pid)
            for e in range(args.engines):
                # XPUB: vLLM's PUB messages, and the node's subscription shows when to start
                pub = ctx.socket(zmq.XPUB)
                pub.setsockopt(zmq.SNDHWM, 1_000_000)
                port = pub.bind_to_random_port("tcp://127.0.0.1")
                r = c.post(
                    "/v1/engines",
                    json={
                        "engine_id": f"engine-{e}",
                        "namespace": ns,
                        "endpoint": f"tcp://127.0.0.1:{port}",
                    },
                )
                assert r.status_code == 201, r.text
                assert pub.poll(60_000), "the node did not subscribe"
                pub.recv()
                pubs.append(pub)
            last = {f"engine-{e}": len(p) - 1 for e, p in enumerate(work.payloads)}
            start_t = time.perf_counter()
            rounds = max(len(p) for p in work.payloads)
            for i in range(rounds):  # the engines interleaved, as a fleet's would be
                for e, pub in enumerate(pubs):
                    if i < len(work.payloads[e]):
                        pub.send_multipart((b"", i.to_bytes(8, "big"), work.payloads[e][i]))
            while True:
                engines = c.get("/v1/engines").json()["engines"]
                if all(x["last_seq"] == last[x["engine_id"]] for x in engines):
                    break
                time.sleep(0.02)
            ingest_s = time.perf_counter() - start_t
            ingested = work.blocks / ingest_s
            held = sum(x["blocks"]["GPU"] for x in engines)
            gaps = sum(x["gaps"] for x in engines)
            rss1 = rss_bytes(proc.pid)

            resolved = c.post("/v1/namespaces/resolve", json={"namespace": ns}).json()
            root = bytes.fromhex(resolved["root"])
            bodies: dict[str, list[bytes]] = {"tokens_b64": [], "block_ids_b64": []}
            for e in range(args.engines):
                prompt = work.prompts[e][len(work.prompts[e]) // 2]
                tb = prompt.astype("<u4").tobytes()
                b64 = base64.b64encode(tb).decode()
                body = {"namespace": ns, "tokens_b64": b64}
                bodies["tokens_b64"].append(json.dumps(body).encode())
                ids = block_hashes_from_bytes(root, tb, bt, resolved["hash_seed"])
                b64 = base64.b64encode(b"".join(ids)).decode()
                bodies["block_ids_b64"].append(
                    json.dumps({"namespace": ns, "block_ids_b64": b64}).encode()
                )
                best = c.post(
                    "/v1/route",
                    content=bodies["tokens_b64"][-1],
                    headers={"content-type": "application/json"},
                ).json()["engines"][0]
                assert best["engine_id"] == f"engine-{e}", best
                assert best["matched_tokens"] == len(prompt) // bt * bt, best
            lat = {"healthz": run(url, "/healthz", None, args.clients, args.requests)}
            for form, b in bodies.items():
                lat[form] = run(url, "/v1/route", b, args.clients, args.requests)
        finally:
            proc.terminate()
            proc.wait(30)
            for pub in pubs:
                pub.close(linger=0)
            ctx.term()

    # the route's server CPU without HTTP, on the reference index
    prompt = work.prompts[0][0]
    tb = prompt.astype("<u4").tobytes()
    rootr = Namespace("bench-route", bt, "bf16", "x").root()
    names = [f"engine-{e}" for e in range(args.engines)]
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(20):
            ids = block_hashes_from_bytes(rootr, tb, bt)
            index.match(ids, names, WEIGHTS)
        best.append((time.perf_counter() - t0) / 20 * 1e3)
    route_cpu_ms = min(best)

    print(
        f"{args.engines} engines, {work.blocks:,} blocks in BlockStored events "
        f"({held:,} held per the node, {gaps} gaps), prompts of {args.tokens} tokens"
    )
    print(f"ingest over ZMQ into the node  {ingested:12,.0f} blocks/s  ({ingest_s:.2f} s)")
    print(f"decode + index in process      {applied:12,.0f} blocks/s")
    print(f"hashing the tokens alone       {hashed:12,.0f} blocks/s")
    print(
        f"ratio node / in-process {ingested / applied:.2f}, in-process / hashing "
        f"{applied / hashed:.2f}"
    )
    print(
        f"node RSS {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB: "
        f"{(rss1 - rss0) / max(held, 1):.0f} bytes per block held"
    )
    print(f"route CPU in process (hash + match, {args.engines} engines) {route_cpu_ms:.3f} ms")
    print(
        f"{'form':<16} {'clients':>7} {'p50 ms':>8} {'p99 ms':>8} {'p50/healthz':>12} "
        f"{'p99/healthz':>12}"
    )
    h50, h99 = pct(lat["healthz"], 50), pct(lat["healthz"], 99)
    figures: dict[str, Any] = {
        "ingest_blocks_per_s": ingested,
        "inprocess_blocks_per_s": applied,
        "hash_blocks_per_s": hashed,
        "bytes_per_block": (rss1 - rss0) / max(held, 1),
        "route_cpu_ms": route_cpu_ms,
    }
    for form, values in lat.items():
        p50, p99 = pct(values, 50), pct(values, 99)
        print(
            f"{form:<16} {args.clients:>7} {p50:8.2f} {p99:8.2f} {p50 / h50:12.2f} "
            f"{p99 / h99:12.2f}"
        )
        figures[f"{form}_p50_ms"] = p50
        figures[f"{form}_p99_ms"] = p99
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
