"""A PRIVATE ``redis-server`` (a free port, never the shared one on 6379) holding the node's
shared tier and fleet index is killed with ``kill -9`` and restarted under a steady stream of
lookups and stores: no lookup fails (the node serves from its local tiers meanwhile), and the
node is strictly ready again within 5 s of Redis coming back."""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.support.servers import free_port, start_server

NS = {"model": "redis-restart", "block_tokens": 4, "kv_dtype": "bf16", "kv_layout": "x"}


def start_redis(port: int, folder: Path) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [
            "redis-server",
            *("--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"),
            *("--dir", str(folder)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with __import__("socket").create_connection(("127.0.0.1", port), timeout=0.2):
                return process
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError("redis-server did not start")


@pytest.fixture
def redis_port(tmp_path: Path) -> Iterator[int]:
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server binary")
    yield free_port()


def test_redis_killed_and_restarted_under_load(tmp_path: Path, redis_port: int) -> None:
    redis = start_redis(redis_port, tmp_path)
    server = start_server(
        tmp_path / "data", {"SESSIONCACHE_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0"}
    )
    failures: list[str] = []
    done = threading.Event()
    counts = [0]

    def load() -> None:
        rng = np.random.default_rng(0)
        with httpx.Client(base_url=server.url, timeout=10) as c:
            i = 0
            while not done.is_set():
                toks = [int(t) for t in rng.integers(0, 999, 16)]
                try:
                    plan = c.post("/v1/store", json={"namespace": NS, "tokens": toks})
                    plan.raise_for_status()
                    for h in plan.json()["missing"]:
                        c.put(f"/v1/blocks/{h}", content=b"r" * 256).raise_for_status()
                    r = c.post("/v1/lookup", json={"namespace": NS, "tokens": toks})
                    r.raise_for_status()
                    if r.json()["matched_blocks"] != 4:
                        failures.append(f"lookup {i} matched {r.json()['matched_blocks']}")
                except httpx.HTTPError as exc:
                    failures.append(f"{i}: {exc!r}")
                counts[0] += 1
                i += 1

    try:
        thread = threading.Thread(target=load, daemon=True)
        thread.start()
        time.sleep(1.0)
        redis.send_signal(signal.SIGKILL)
        redis.wait(10)
        time.sleep(1.5)  # the node runs degraded
        during = counts[0]
        redis = start_redis(redis_port, tmp_path)
        back = time.monotonic()
        ready_after = None
        while time.monotonic() - back < 15:
            r = httpx.get(f"{server.url}/readyz", params={"strict": "true"})
            if r.status_code == 200:
                ready_after = time.monotonic() - back
                break
            time.sleep(0.1)
        time.sleep(0.5)
        done.set()
        thread.join(30)
        assert not failures, failures[:5]
        assert counts[0] > during > 0
        assert ready_after is not None and ready_after < 5.0, ready_after
    finally:
        done.set()
        server.stop()
        redis.kill()
        redis.wait(10)


def test_chains_stored_while_redis_was_down_reach_the_other_nodes_once_it_is_back(
    tmp_path: Path, redis_port: int
) -> None:
    """Two nodes on one private Redis (the shared tier). Redis dies (and comes back empty:
    no persistence); node A stores 5 chains meanwhile, each answered 2xx and held by A alone.
    Once Redis is back, A publishes them in the background: node B finds all 5 within 30 s."""
    redis = start_redis(redis_port, tmp_path)
    env = {"SESSIONCACHE_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0"}
    a = start_server(tmp_path / "a", env)
    b = start_server(tmp_path / "b", env)
    rng = np.random.default_rng(11)
    chains = [[int(t) for t in rng.integers(0, 999, 16)] for _ in range(5)]
    try:
        redis.send_signal(signal.SIGKILL)
        redis.wait(10)
        with httpx.Client(base_url=a.url, timeout=30) as c:
            for toks in chains:
                plan = c.post("/v1/store", json={"namespace": NS, "tokens": toks})
                assert plan.status_code == 200, plan.text
                for h in plan.json()["missing"]:
                    r = c.put(f"/v1/blocks/{h}", content=bytes.fromhex(h) * 16)
                    assert r.status_code == 200, r.text
        redis = start_redis(redis_port, tmp_path)
        back = time.monotonic()
        seen: list[int] = []
        with httpx.Client(base_url=b.url, timeout=30) as c:
            while time.monotonic() - back < 30:
                seen = [
                    c.post("/v1/lookup", json={"namespace": NS, "tokens": toks}).json()[
                        "matched_blocks"
                    ]
                    for toks in chains
                ]
                if seen == [4] * 5:
                    break
                time.sleep(0.5)
            print(f"B sees {seen} after {time.monotonic() - back:.1f} s")
            assert seen == [4] * 5, seen
            for toks in chains:  # and reads them, byte-exact
                plan = c.post("/v1/lookup", json={"namespace": NS, "tokens": toks}).json()
                for block in plan["blocks"]:
                    h = block["hash"]
                    assert c.get(f"/v1/blocks/{h}").content == bytes.fromhex(h) * 16
    finally:
        a.stop()
        b.stop()
        redis.kill()
        redis.wait(10)
