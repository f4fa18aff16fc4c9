"""Lookup latency over loopback: p50/p99 for 8K / 32K / 128K-token prompts, 1 / 8 / 32
concurrent clients, by JSON tokens, by binary (``tokens_b64``) tokens, by block id
(``block_ids_b64``, the compact answer), and ``session``: binary tokens naming a session whose
stored prompt they extend by an eighth (the next turn of an agent: the miss attribution
classifies the eighth), each beside ``GET /healthz`` with the ratios.

A real ``sessioncache serve`` process is started on a free port (CPU tier only) and every
prompt's chain is stored first, so each lookup matches the whole prompt. The id lookup's ids
are computed the way the connector does: ``POST /v1/namespaces/resolve`` once, then
``block_hashes_from_bytes`` from its root. Request bodies are encoded once up front and each
client is its own process: the figures are the server's and the loopback's, not the client's
JSON encoder; clients and server share this machine's two cores. The reference printed beside
them is the same number of empty ``GET /healthz`` round trips at the same concurrency (the
HTTP floor of this machine), measured in the same rounds: with ``--rounds R`` every round runs
the floor and then each form, so that load from elsewhere hits all of them alike.

``--compare-tree DIR`` serves a second node from another source tree (another commit, e.g.
``git archive <commit> | tar -x -C DIR``) and measures it in the same rounds, each against its
own ``/healthz``: before and after under the same noise.

Run: ``python -m bench.lookup [--requests 200] [--rounds 1] [--block-tokens 16]
[--tokens 8192 32768 131072] [--clients 1 8 32] [--forms json binary ids]
[--compare-tree DIR [--compare-label base]]``.
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

from sessioncache.hashing import Namespace, block_hashes_from_bytes

PROMPTS = [8192, 32768, 131072]
CONCURRENCY = [1, 8, 32]
FORMS = ["json", "binary", "ids", "session", "stream", "unix"]
DATAPLANE_FORMS = {"stream", "unix"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(
    data_dir: Path,
    cpu_bytes: int = 1 << 30,
    tree: Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """A server of this tree, or of the source tree ``tree`` (another commit's checkout);
    ``extra_env``: more settings (``SESSIONCACHE_*``)."""
    port = free_port()
    env = {
        **os.environ,
        "SESSIONCACHE_CPU_BYTES": str(cpu_bytes),
        "SESSIONCACHE_DISK_BYTES": "0",
        "SESSIONCACHE_DURABLE_UPLOADS": "false",
        "SESSIONCACHE_STREAM_PORT": "0",
        **(extra_env or {}),
    }
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
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
        cwd=tree,
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


def _dataplane_client(url: str, form: str, body: bytes, count: int) -> list[float]:
    """LOOKUPs over the block stream (TCP) or the same-host Unix socket: one connection, the
    ids the client computed, a binary answer."""
    from sessioncache.connector.samehost import SameHostClient
    from sessioncache.connector.stream import StreamClient

    ns_len = int.from_bytes(body[:4], "little")
    namespace = Namespace(**json.loads(body[4 : 4 + ns_len]))
    rest = body[4 + ns_len :]
    ids = [rest[i : i + 16] for i in range(0, len(rest), 16)]
    cls = SameHostClient if form == "unix" else StreamClient
    out = []
    with cls.discover(url) as conn:
        root = conn.resolve(namespace)
        for _ in range(count):
            start = time.perf_counter()
            found = conn.lookup(root, ids)
            out.append(time.perf_counter() - start)
            assert found.matched == len(ids), found.matched
    return out


def _client(job: tuple[str, str, bytes | None, int]) -> list[float]:
    url, path, body, count = job
    if path in DATAPLANE_FORMS:
        assert body is not None
        return _dataplane_client(url, path, body, count)
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


def prepare(
    url: str, ns: dict[str, object], prompts: list[int], block_tokens: int, forms: list[str]
) -> dict[tuple[int, str], bytes]:
    """Store every prompt's chain on the server at ``url`` and encode the lookup bodies of
    ``forms`` (the ids form only where the server resolves namespaces)."""
    rng = np.random.default_rng(0)
    bodies: dict[tuple[int, str], bytes] = {}
    with httpx.Client(base_url=url, timeout=120) as c:
        resolved = None
        if {"ids", *DATAPLANE_FORMS} & set(forms):
            r = c.post("/v1/namespaces/resolve", json={"namespace": ns})
            resolved = r.json() if r.status_code == 200 else None
        for n in prompts:
            toks = rng.integers(0, 128_000, n, dtype=np.uint32)
            token_bytes = toks.astype("<u4").tobytes()
            plan = c.post("/v1/store", json={"namespace": ns, "tokens": toks.tolist()})
            for h in plan.json()["missing"]:
                c.put(f"/v1/blocks/{h}", content=b"\0" * 64)
            if "json" in forms:
                bodies[(n, "json")] = json.dumps(
                    {"namespace": ns, "tokens": toks.tolist()}
                ).encode()
            if "binary" in forms:
                b64 = base64.b64encode(token_bytes).decode()
                bodies[(n, "binary")] = json.dumps({"namespace": ns, "tokens_b64": b64}).encode()
            if resolved is not None:
                root = bytes.fromhex(resolved["root"])
                ids = block_hashes_from_bytes(
                    root, token_bytes, block_tokens, resolved["hash_seed"]
                )
                if "ids" in forms:
                    b64 = base64.b64encode(b"".join(ids)).decode()
                    body = json.dumps({"namespace": ns, "block_ids_b64": b64}).encode()
                    bodies[(n, "ids")] = body
                ns_json = json.dumps(ns).encode()
                for form in DATAPLANE_FORMS & set(forms):
                    head = len(ns_json).to_bytes(4, "little") + ns_json
                    bodies[(n, form)] = head + b"".join(ids)
            if "session" in forms:
                # the next turn of a session that stored the prompt: an eighth more, new (the
                # miss attribution's usual work; a tree without it serves the same request)
                sid = f"bench-{n}"
                c.post("/v1/sessions", json={"session_id": sid})
                plan = {"namespace": ns, "tokens": toks.tolist(), "session_id": sid}
                c.post("/v1/store", json=plan)
                more = rng.integers(0, 128_000, n // 8, dtype=np.uint32).astype("<u4").tobytes()
                b64 = base64.b64encode(token_bytes + more).decode()
                bodies[(n, "session")] = json.dumps(
                    {"namespace": ns, "tokens_b64": b64, "session_id": sid}
                ).encode()
            for (m, _form), body in bodies.items():
                if m != n or _form in DATAPLANE_FORMS:
                    continue
                check = c.post(
                    "/v1/lookup", content=body, headers={"content-type": "application/json"}
                ).json()
                assert check["matched_tokens"] == n // block_tokens * block_tokens, check
    return bodies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200, help="per configuration and round")
    parser.add_argument(
        "--rounds", type=int, default=1, help="alternate the floor and the forms this often"
    )
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--tokens", type=int, nargs="+", default=PROMPTS, help="prompt lengths")
    parser.add_argument(
        "--clients", type=int, nargs="+", default=CONCURRENCY, help="concurrent clients"
    )
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=FORMS, help="lookup forms")
    parser.add_argument(
        "--compare-tree",
        type=Path,
        help="also serve from this source tree (e.g. `git archive <commit>` unpacked) and "
        "measure it in the same rounds; its rows are marked @<--compare-label>",
    )
    parser.add_argument("--compare-label", default="base")
    args = parser.parse_args()
    ns: dict[str, object] = {
        "model": "bench",
        "block_tokens": args.block_tokens,
        "kv_dtype": "bf16",
        "kv_layout": "bench",
    }
    trees: list[tuple[str, Path | None]] = [("", None)]
    if args.compare_tree is not None:
        trees.append((f"@{args.compare_label}", args.compare_tree.resolve()))
    with tempfile.TemporaryDirectory() as tmp:
        servers: list[tuple[str, subprocess.Popen[bytes], str]] = []
        try:
            for i, (label, tree) in enumerate(trees):
                proc, url = start(Path(tmp) / f"data{i}", tree=tree)
                servers.append((label, proc, url))
            bodies = {
                label: prepare(url, ns, args.tokens, args.block_tokens, args.forms)
                for label, _, url in servers
            }
            print(
                f"{'tokens':>7} {'form':>11} {'clients':>7} {'p50 ms':>8} {'p99 ms':>8} "
                f"{'healthz p50':>11} {'p99':>7} {'p50/hz':>7} {'p99/hz':>7}"
            )
            for clients in args.clients:
                per_client = max(1, args.requests // clients)
                floor: dict[str, list[float]] = {}
                lat: dict[tuple[str, int, str], list[float]] = {}
                for _ in range(args.rounds):
                    for label, _, url in servers:
                        floor.setdefault(label, []).extend(
                            run(url, "/healthz", None, clients, per_client)
                        )
                        for (n, form), body in bodies[label].items():
                            path = form if form in DATAPLANE_FORMS else "/v1/lookup"
                            lat.setdefault((label, n, form), []).extend(
                                run(url, path, body, clients, per_client)
                            )
                for (label, n, form), values in lat.items():
                    f50, f99 = pct(floor[label], 50), pct(floor[label], 99)
                    p50, p99 = pct(values, 50), pct(values, 99)
                    print(
                        f"{n:>7} {form + label:>11} {clients:>7} {p50:8.2f} {p99:8.2f} "
                        f"{f50:11.2f} {f99:7.2f} {p50 / f50:7.2f} {p99 / f99:7.2f}",
                        flush=True,
                    )
        finally:
            for _, proc, _ in servers:
                proc.terminate()
                proc.wait(10)


if __name__ == "__main__":
    main()
