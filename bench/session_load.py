"""A session's load of its cached prefix through ``KVTransfer`` on the stream and the same-host
path: ``load_into(tokens, out, session_id=...)`` of a 128-block chain (64-token blocks of 256
KiB, 32 MiB) from a real ``sessioncache serve``, timed end to end in the client:
the block ids, the session's lookup (its TTL, pins and head) and the copy. Printed beside the
same load without a session, on the same connection, in the same rounds. First on the node a
user starts (README defaults: the disk tier on, durable uploads), then, labelled ``cpu_only``,
on one without its disk tier.

Run: ``python -m bench.session_load [--loads 60] [--json]``. It uses only the public client
API, so it runs against another tree's code as well: ``python -m bench.compare
bench/session_load.py --compare-tree DIR --lower _ms`` runs it from both trees in turns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.lookup import start
from sessioncache.connector import SessionCacheClient
from sessioncache.connector.transfer import KVTransfer
from sessioncache.hashing import Namespace

BLOCK_TOKENS, BLOCKS, SIZE = 64, 128, 256 * 1024
DEFAULT_NODE = {"SESSIONCACHE_DISK_BYTES": str(64 << 30), "SESSIONCACHE_DURABLE_UPLOADS": "true"}
"""The README's defaults, which ``bench.lookup.start`` turns off."""


def measure(url: str, path: str, loads: int) -> dict[str, float]:
    namespace = Namespace(f"session-load-{path}", BLOCK_TOKENS, "bf16", "x")
    with (
        SessionCacheClient(url, namespace=namespace) as client,
        KVTransfer(client, path=path) as kv,
    ):  # type: ignore[arg-type]
        rng = np.random.default_rng(0)
        tokens = [int(t) for t in rng.integers(0, 50_000, BLOCK_TOKENS * BLOCKS)]
        session = client.open_session(kind="agent")
        blocks = [rng.integers(0, 256, SIZE, dtype=np.uint8) for _ in range(BLOCKS)]
        kv.store_from(tokens, blocks, session_id=session.id)
        out = [np.zeros(SIZE, np.uint8) for _ in range(BLOCKS)]
        timed: dict[str, list[float]] = {"session": [], "plain": []}
        for _ in range(loads):
            for case, sid in (("session", session.id), ("plain", None)):
                t0 = time.perf_counter()
                got = kv.load_into(tokens, out, session_id=sid).blocks
                timed[case].append(time.perf_counter() - t0)
                if got != BLOCKS:
                    raise RuntimeError(f"{case}: {got} of {BLOCKS} blocks loaded")
        for got_block, want in zip(out, blocks, strict=True):
            if not np.array_equal(got_block, want):
                raise RuntimeError("a loaded block differs from the stored one")
    return {
        f"{case}_{stat}_ms": round(fn(times) * 1e3, 3)
        for case, times in timed.items()
        for stat, fn in (("min", min), ("median", statistics.median))
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--loads", type=int, default=60)
    parser.add_argument("--paths", nargs="+", default=["same_host", "stream"])
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    nodes = {"": DEFAULT_NODE, "cpu_only.": {}}  # bench.lookup.start leaves the disk tier out
    for label, env in nodes.items():
        with tempfile.TemporaryDirectory() as tmp:
            proc, url = start(Path(tmp) / "data", cpu_bytes=1 << 30, extra_env=env)
            try:
                for path in args.paths:
                    results[f"{label}{path}"] = measure(url, path, args.loads)
            finally:
                proc.terminate()
                proc.wait(10)
    print(f"{BLOCKS} blocks of {SIZE >> 10} KiB, {args.loads} loads each, ms")
    for path, figures in results.items():
        print(f"{path:<19} " + "  ".join(f"{k} {v:.2f}" for k, v in figures.items()))
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
