"""Server cost of one lookup, in-process: where a lookup's time goes, without the loopback.

A node is opened as ``sessioncache serve`` opens it (CPU tier, SQLite catalog in a temporary
folder), a prompt's chain is stored, and then each stage is timed alone, one call after
another on this thread: hashing the prompt, ``CacheNode.lookup`` (tokens) and
``CacheNode.lookup_ids`` with their parts, and whole requests through the ASGI app (routing,
validation, dependencies, thread pool, answer; no sockets and no HTTP parsing) for
``GET /healthz``, a session's next turn (its stored prompt and an eighth more, new: what
miss attribution classifies; with ``explain`` too), a token lookup (``tokens_b64``, full
answer) and a lookup by id (``block_ids_b64``, compact answer). Best and median of
``--repeat`` runs, in ms: on a shared machine the best is the cost, the median the noise.
``--profile`` adds cProfile's top functions for the lookups, with the thread pool run inline
so that the profile sees the work.

Run: ``python -m bench.lookup_cpu [--tokens 32768] [--block-tokens 16] [--repeat 300]
[--profile]``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from sessioncache.api.app import create_app
from sessioncache.attribution import Lookup
from sessioncache.config import Settings
from sessioncache.factory import open_node
from sessioncache.hashing import Namespace, block_hashes_from_bytes
from sessioncache.operations import lookups, stores
from sessioncache.operations.caller import Caller


async def asgi_call(app: Any, method: str, path: str, body: bytes) -> tuple[int, bytes]:
    """One request through the ASGI app, no server."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "state": {},
    }
    sent = False
    status = 0
    out: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            out.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(out)


def report(label: str, seconds: list[float]) -> None:
    ms = sorted(s * 1e3 for s in seconds)
    print(f"{label:44s} {ms[0]:8.3f} {statistics.median(ms):8.3f}", flush=True)


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    fn()
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


async def atimed(fn: Callable[[], Awaitable[object]], repeat: int) -> list[float]:
    await fn()
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--profile", action="store_true", help="cProfile the two lookups")
    args = parser.parse_args()
    ns_json: dict[str, Any] = {
        "model": "bench",
        "block_tokens": args.block_tokens,
        "kv_dtype": "bf16",
        "kv_layout": "bench",
    }
    ns = Namespace(**ns_json)
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(
            data_dir=Path(tmp) / "data", cpu_bytes=1 << 30, disk_bytes=0, durable_uploads=False
        )
        node = open_node(settings, start=False)
        app = create_app(node)
        tb = np.random.default_rng(0).integers(0, 128_000, args.tokens).astype("<u4").tobytes()
        plan = stores.plan_upload(node, Caller("default"), ns, tb)
        for h in plan.missing:
            stores.upload(node, Caller("default"), h, b"\0" * 64)
        root = node.namespace_root("default", ns)
        seed = settings.hash_seed
        ids = block_hashes_from_bytes(root, tb, args.block_tokens, seed)
        tokens_body = json.dumps(
            {"namespace": ns_json, "tokens_b64": base64.b64encode(tb).decode()}
        )
        ids_body = json.dumps(
            {"namespace": ns_json, "block_ids_b64": base64.b64encode(b"".join(ids)).decode()}
        )
        # the next turn of a session that stored the prompt: an eighth more, new
        node.sessions.open("bench-turn", tenant="default")
        stores.plan_upload(node, Caller("default"), ns, tb, session_id="bench-turn")
        more = np.random.default_rng(2).integers(0, 128_000, args.tokens // 8)
        turn = tb + more.astype("<u4").tobytes()
        turn_json: dict[str, Any] = {
            "namespace": ns_json,
            "tokens_b64": base64.b64encode(turn).decode(),
            "session_id": "bench-turn",
        }
        requests = {
            "GET /healthz": ("GET", "/healthz", b""),
            "POST /v1/lookup session turn": ("POST", "/v1/lookup", json.dumps(turn_json).encode()),
            "POST /v1/lookup tokens_b64 (full answer)": (
                "POST",
                "/v1/lookup",
                tokens_body.encode(),
            ),
            "POST /v1/lookup block_ids_b64 (compact)": ("POST", "/v1/lookup", ids_body.encode()),
        }
        if hasattr(node, "attribution"):  # absent before miss attribution
            explained = json.dumps({**turn_json, "explain": True}).encode()
            requests["POST /v1/lookup session turn, explain"] = ("POST", "/v1/lookup", explained)
        n = args.repeat
        print(f"{len(ids)} blocks of {args.block_tokens} tokens; ms per call, {n} calls")
        print(f"{'stage':44s} {'best':>8} {'median':>8}")
        bt = args.block_tokens
        report("hash the prompt", timed(lambda: block_hashes_from_bytes(root, tb, bt, seed), n))
        report(
            "CacheNode.lookup (tokens)",
            timed(lambda: lookups.lookup_tokens(node, Caller("default"), ns, tb), n),
        )
        if hasattr(node, "lookup_ids"):  # absent before lookups by id (to measure "before")
            report(
                "CacheNode.lookup_ids",
                timed(lambda: lookups.lookup_ids(node, Caller("default"), ns, ids), n),
            )
            report(
                "  of which chain_prefix", timed(lambda: lookups.chain_prefix(node, root, ids), n)
            )
        report("TieredStore.lookup", timed(lambda: node.store.reads.lookup(ids), n))
        if hasattr(node, "attribution"):  # absent before miss attribution
            attribution_costs(node, ns, tb, n)

        async def over_asgi() -> None:
            async with app.router.lifespan_context(app):
                for label, (method, path, body) in requests.items():
                    status, answer = await asgi_call(app, method, path, body)
                    if status == 422 and b"block_ids_b64" in body:
                        print(f"{label:44s} (not served)")
                        continue
                    assert status == 200, answer[:300]

                    def call(m: str = method, p: str = path, b: bytes = body) -> Awaitable[object]:
                        return asgi_call(app, m, p, b)

                    report(label, await atimed(call, n))
                if hasattr(node, "attribution"):
                    cold = rng_tokens(3, args.tokens // 4)
                    cold_body = json.dumps(
                        {"namespace": ns_json, "tokens_b64": base64.b64encode(cold).decode()}
                    ).encode()
                    await attribution_ab(
                        app,
                        node,
                        {
                            "session turn": requests["POST /v1/lookup session turn"][2],
                            f"{len(cold) // 4 // bt} new blocks": cold_body,
                        },
                        n,
                    )
                if args.profile:
                    await profile(app, requests)

        asyncio.run(over_asgi())


def rng_tokens(seed: int, n: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 128_000, n).astype("<u4").tobytes()


async def attribution_ab(app: Any, node: Any, bodies: dict[str, bytes], n: int) -> None:
    """Whole ``POST /v1/lookup`` requests with miss attribution on and off (a classifier that
    does nothing), alternating in rounds of 10 so that load from elsewhere hits both alike:
    attribution's share of the request's server time."""
    from sessioncache.attribution import MissReport

    real = node.attribution.lookup

    def off(*args: Any, **kwargs: Any) -> MissReport:
        return MissReport(None, {}, None)

    for label, body in bodies.items():
        times: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(max(1, n // 10)):
            for mode, fn in (("on", real), ("off", off)):
                node.attribution.lookup = fn
                for _ in range(10):
                    start = time.perf_counter()
                    status, answer = await asgi_call(app, "POST", "/v1/lookup", body)
                    times[mode].append(time.perf_counter() - start)
                    assert status == 200, answer[:300]
        node.attribution.lookup = real
        report(f"POST /v1/lookup {label}, attribution on", times["on"])
        report(f"POST /v1/lookup {label}, attribution off", times["off"])
        on, off_ = sorted(times["on"]), sorted(times["off"])
        q = len(on) // 4
        median = statistics.median(on) / statistics.median(off_)
        print(
            f"attribution on/off ({label}): best {on[0] / off_[0]:.3f}, "
            f"quartile {on[q] / off_[q]:.3f}, median {median:.3f}",
            flush=True,
        )


def attribution_costs(node: Any, ns: Namespace, tb: bytes, n: int) -> None:
    """Miss attribution's share of a lookup: the next turn of a session (the stored prompt
    plus an eighth more, new), with a ring of dropped ids as full as the default allows, and a
    prompt nothing of which is held (every block asks the rings)."""
    rng = np.random.default_rng(1)
    grown = tb + rng.integers(0, 128_000, len(tb) // 32).astype("<u4").tobytes()
    cold = rng.integers(0, 128_000, len(tb) // 4).astype("<u4").tobytes()
    node.sessions.open("bench-session", tenant="default")
    stores.plan_upload(node, Caller("default"), ns, tb, session_id="bench-session")
    drops = node.attribution.drops
    if not sum(drops.size().values()):  # a full ring: as after a day of evictions
        meta = node.store.reads.meta(node.hashes("default", ns, tb)[0])
        for i in range(node.settings.attribution_ring_blocks):
            meta.block_hash = i.to_bytes(16, "little")
            drops.block_dropped(meta, "cpu", 0.0)
    root = node.namespace_root("default", ns)
    bt = ns.block_tokens
    session = ("bench-session", "default")
    hashes = node.hashes("default", ns, grown)
    matched = len(tb) // 4 // bt
    cold_hashes = node.hashes("default", ns, cold)
    print(f"attribution: session turn of {len(hashes)} blocks, {len(hashes) - matched} new")
    whole = timed(
        lambda: lookups.lookup_tokens(
            node, Caller("default"), ns, grown, session_id="bench-session"
        ),
        n,
    )
    part = timed(
        lambda: node.attribution.lookup(
            Lookup(root, hashes, matched, bt, len(grown) // 4, grown), session=session
        ),
        n,
    )
    report("CacheNode.lookup (tokens, session turn)", whole)
    report("  of which Attribution.lookup", part)
    cold_whole = timed(lambda: lookups.lookup_tokens(node, Caller("default"), ns, cold), n)
    cold_part = timed(
        lambda: node.attribution.lookup(Lookup(root, cold_hashes, 0, bt, len(cold) // 4)), n
    )
    report(f"CacheNode.lookup (tokens, {len(cold_hashes)} new)", cold_whole)
    report("  of which Attribution.lookup", cold_part)
    for label, a, b in (("session turn", part, whole), ("all new", cold_part, cold_whole)):
        share = statistics.median(a) / statistics.median(b)
        print(f"attribution share of the lookup ({label}, medians): {share:.1%}")


async def profile(app: Any, requests: dict[str, tuple[str, str, bytes]]) -> None:
    """cProfile of each lookup request, with FastAPI's thread pool run inline."""
    import fastapi.dependencies.utils
    import fastapi.routing

    import sessioncache.api.routes.lookup

    async def inline(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    modules = (fastapi.routing, fastapi.dependencies.utils, sessioncache.api.routes.lookup)
    saved = [getattr(m, "run_in_threadpool", None) for m in modules]
    for m in modules:
        if hasattr(m, "run_in_threadpool"):
            m.run_in_threadpool = inline  # type: ignore[attr-defined]
    try:
        for label, (method, path, body) in list(requests.items())[1:]:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(100):
                await asgi_call(app, method, path, body)
            prof.disable()
            print(f"\n== cProfile, 100 x {label}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    finally:
        for m, fn in zip(modules, saved, strict=True):
            if fn is not None:
                m.run_in_threadpool = fn  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
