"""A session's chain demoted to disk, prefetched into the CPU tier, then loaded with the public
client (``KVTransfer.load_into`` on the block stream), beside the same load of a twin chain
straight from disk, a memcpy of the same bytes and ``dd`` of a file of the same bytes, in one
run. Before each disk load the tier's files (and dd's file) are dropped from the page cache
(``posix_fadvise(DONTNEED)``), as after a night: that is where a returning session's blocks
are.

The node is the README's default (CPU tier over the disk tier, write-behind), run in this
process so that the bench can watch the chain's tiers (``node.prefetch.resident``); two
settings differ: a CPU tier of ``--cpu-mib`` (so that filler sessions of 1.25 times it,
stored after each chain until it is on disk, demote the chains without writing gigabytes)
and sessions idle after 1 s (so that their pins go at once). The forecast prefetch is off,
so that the twin chain stays on disk until its load. Both loads start on an idle disk (the
write-behind drained) with the tier's files out of the page cache. The prefetch is asked
over REST (``POST /v1/sessions/{id}/prefetch``) where the node serves it, else through
``node.prefetch.request`` (the engine the route calls); the output says which. Each round
starts a fresh node and stores a fresh pair of chains.

Printed per round and as medians: the prefetch (request to ``resident.cpu`` = the chain's
length), the load after it, the load from disk, memcpy and dd, and the ratio prefetched /
disk (target: at most 0.5).

Run: ``python -m bench.prefetch [--chain-mib 64] [--cpu-mib 256] [--rounds 3] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.tiers import drop_from_page_cache
from sessioncache.connector import SessionCacheClient
from sessioncache.connector.transfer import KVTransfer
from sessioncache.hashing import Namespace
from sessioncache.node import OPEN_TENANT, CacheNode

BLOCK_TOKENS, SIZE = 64, 256 * 1024
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """A node of this tree in this process: REST on uvicorn in a thread, the block stream."""

    def __init__(self, data_dir: Path, cpu_bytes: int) -> None:
        import uvicorn

        from sessioncache.api.app import create_app
        from sessioncache.config import Settings
        from sessioncache.dataplane.server import open_stream_server
        from sessioncache.factory import open_node

        port = free_port()
        settings = Settings(
            data_dir=data_dir,
            cpu_bytes=cpu_bytes,
            idle_timeout_s=1.0,
            sweep_interval_s=1.0,
            prefetch_forecast=False,
            port=port,
            stream_port=0,
            shm=False,
        )
        self.node: CacheNode = open_node(settings)
        stream = open_stream_server(self.node, settings)
        app = create_app(self.node, stream=stream)
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(f"{self.url}/healthz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the node did not start")

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)


def prefetch(served: Served, session_id: str) -> str:
    """Ask for the prefetch until it is accepted (a deferred one is asked again); which way
    it was asked."""
    t0 = time.perf_counter()
    while True:
        reply = httpx.post(f"{served.url}/v1/sessions/{session_id}/prefetch", timeout=30)
        if reply.status_code in (404, 405):
            how = "node.prefetch.request"
            answer = asdict(served.node.prefetch.request((OPEN_TENANT, session_id)))
        else:
            reply.raise_for_status()
            how, answer = "REST", reply.json()
        if answer["outcome"] == "accepted":
            return how
        if answer["outcome"] != "deferred" or time.perf_counter() - t0 > 30:
            raise RuntimeError(f"prefetch: {answer}")
        time.sleep(0.05)


def memcpy_s(nbytes: int) -> float:
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = 0
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return best


def dd_s(folder: Path, nbytes: int) -> float:
    """``dd`` of a file of ``nbytes`` (written, fsynced, dropped from the page cache) to
    /dev/null."""
    path = folder / "dd.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
        f.flush()
        os.fsync(f.fileno())
    drop_from_page_cache(folder)
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", "bs=4M"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    took = time.perf_counter() - t0
    path.unlink()
    return took


def wait_resident(served: Served, session_id: str, blocks: int, tier: str = "cpu") -> float:
    t0 = time.perf_counter()
    while served.node.prefetch.resident((OPEN_TENANT, session_id)).get(tier, 0) < blocks:
        if time.perf_counter() - t0 > 120:
            raise RuntimeError(f"{session_id}: not in the {tier} tier after 120 s")
        time.sleep(0.01)
    return time.perf_counter() - t0


def wait_demoted(served: Served, session_ids: list[str], blocks: int) -> None:
    """Until the chains are on disk only (their CPU copies evicted, their disk copies
    written)."""
    t0 = time.perf_counter()
    while True:
        res = [served.node.prefetch.resident((OPEN_TENANT, s)) for s in session_ids]
        if all(r.get("cpu", 0) == 0 and r.get("disk", 0) == blocks for r in res):
            return
        if time.perf_counter() - t0 > 120:
            pinned = served.node.sessions.pinned_sessions()
            raise RuntimeError(f"chains not demoted: {res}; pinned sessions {pinned}")
        time.sleep(0.05)


def wait_idle_disk(served: Served) -> None:
    """Until the write-behind has written everything (the disk idle)."""
    behind = served.node.store.write_behind
    t0 = time.perf_counter()
    while behind is not None and behind.backlog_bytes:
        if time.perf_counter() - t0 > 120:
            raise RuntimeError("the write-behind did not drain in 120 s")
        time.sleep(0.05)


def round_(served: Served, data: Path, index: int, blocks: int, filler: int) -> dict[str, Any]:
    namespace = Namespace(f"prefetch-bench-{index}", BLOCK_TOKENS, "bf16", "x")
    rng = np.random.default_rng(index)
    with (
        SessionCacheClient(served.url, namespace=namespace) as client,
        KVTransfer(client, path="stream") as kv,
    ):  # type: ignore[arg-type]
        chains: dict[str, list[int]] = {}
        payloads = [rng.integers(0, 256, SIZE, dtype=np.uint8) for _ in range(blocks)]
        for twin in range(2):  # the chain prefetched, then its twin loaded from disk
            tokens = [int(t) for t in rng.integers(0, 50_000, BLOCK_TOKENS * blocks)]
            session = client.open_session(kind="agent")
            kv.store_from(tokens, payloads, session_id=session.id)
            client.finish_session(session.id, "stop")  # back in minutes or hours: goes first
            chains[session.id] = tokens
            time.sleep(2.5)  # idle: unpinned by the sweep
            for _ in range(4):  # fillers push it down to disk
                fill = client.open_session(kind="agent")
                fill_tokens = [int(t) for t in rng.integers(0, 50_000, BLOCK_TOKENS * filler)]
                filler_payloads = [payloads[(i + twin) % blocks] for i in range(filler)]
                kv.store_from(fill_tokens, filler_payloads, session_id=fill.id)
                client.close_session(fill.id)  # its pins go: none but what a load pins
                wait_idle_disk(served)
                if served.node.prefetch.resident((OPEN_TENANT, session.id))["cpu"] == 0:
                    break
        ids = list(chains)
        wait_demoted(served, ids, blocks)
        wait_idle_disk(served)
        drop_from_page_cache(data / "blocks")
        out = [np.zeros(SIZE, np.uint8) for _ in range(blocks)]
        # the twin straight from disk
        t0 = time.perf_counter()
        got = kv.load_into(chains[ids[1]], out, session_id=ids[1]).blocks
        disk = time.perf_counter() - t0
        if got != blocks:
            raise RuntimeError(f"disk load: {got} of {blocks} blocks")
        client.close_session(ids[1])  # its pins go too
        wait_idle_disk(served)
        drop_from_page_cache(data / "blocks")
        t0 = time.perf_counter()
        how = prefetch(served, ids[0])
        asked = time.perf_counter() - t0
        moved = wait_resident(served, ids[0], blocks) + asked
        t0 = time.perf_counter()
        got = kv.load_into(chains[ids[0]], out, session_id=ids[0]).blocks
        loaded = time.perf_counter() - t0
        if got != blocks:
            raise RuntimeError(f"prefetched load: {got} of {blocks} blocks")
        for got_block, want in zip(out, payloads, strict=True):
            if not np.array_equal(got_block, want):
                raise RuntimeError("a loaded block differs from the stored one")
        client.close_session(ids[0])
    return {
        "prefetch_via": how,
        "prefetch_s": moved,
        "prefetched_load_s": loaded,
        "disk_load_s": disk,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chain-mib", type=int, default=64)
    parser.add_argument("--cpu-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    blocks = args.chain_mib * MiB // SIZE
    filler = args.cpu_mib * MiB * 5 // 4 // SIZE
    nbytes = blocks * SIZE
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        for i in range(args.rounds):  # a fresh node each round: nothing left of the last
            data = Path(tmp) / f"data{i}"
            served = Served(data, args.cpu_mib * MiB)
            try:
                rounds.append(round_(served, data, i, blocks, filler))
            finally:
                served.close()
        memcpy = memcpy_s(nbytes)
        dd = dd_s(Path(tmp), nbytes)
    med = {
        key: statistics.median(r[key] for r in rounds)
        for key in ("prefetch_s", "prefetched_load_s", "disk_load_s")
    }
    gib = nbytes / (1 << 30)
    print(
        f"a chain of {blocks} blocks of {SIZE >> 10} KiB ({nbytes / MiB:.0f} MiB), "
        f"{args.rounds} rounds, prefetch asked through {rounds[0]['prefetch_via']}"
    )
    for i, r in enumerate(rounds):
        print(
            f"round {i}: prefetch {r['prefetch_s'] * 1e3:.1f} ms, prefetched load "
            f"{r['prefetched_load_s'] * 1e3:.1f} ms, load from disk {r['disk_load_s'] * 1e3:.1f} ms"
        )
    ratio = med["prefetched_load_s"] / med["disk_load_s"]
    print(
        f"median: prefetch {med['prefetch_s'] * 1e3:.1f} ms ({med['prefetch_s'] / gib:.2f} s per "
        f"GiB), prefetched load {med['prefetched_load_s'] * 1e3:.1f} ms, load from disk "
        f"{med['disk_load_s'] * 1e3:.1f} ms, memcpy {memcpy * 1e3:.1f} ms, dd {dd * 1e3:.1f} ms"
    )
    print(
        f"prefetched load / load from disk: {ratio:.3f}x (target <= 0.5); load from disk / dd: "
        f"{med['disk_load_s'] / dd:.2f}x; prefetched load / memcpy: "
        f"{med['prefetched_load_s'] / memcpy:.1f}x"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "rounds": rounds,
                    **{f"{k}_median": v for k, v in med.items()},
                    "memcpy_s": memcpy,
                    "dd_s": dd,
                    "ratio_prefetched_to_disk": ratio,
                    "chain_bytes": nbytes,
                }
            )
        )


if __name__ == "__main__":
    main()
