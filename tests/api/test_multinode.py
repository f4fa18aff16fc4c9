"""Several ``sessioncache serve`` processes sharing one Redis (standalone or a real 3-master
Redis Cluster) and one PostgreSQL catalog: a chain stored through node A hits and loads
byte-exact through node B, and a session opened on A continues on B. Then Redis is stopped
mid-load and restarted: no lookup fails, and the node recovers on its own."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import numpy as np
import psycopg
import pytest
import redis

from tests.support.servers import Server, start_server

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
NS = {"model": "fleet-model", "block_tokens": 16, "kv_dtype": "bf16", "kv_layout": "x"}


def _support() -> ModuleType:
    name = "sessioncache_tests_redis_support"
    if name not in sys.modules:
        path = Path(__file__).parents[1] / "support" / "redis_cluster.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture
def schema() -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test", autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def fleet_env(redis_url: str, prefix: str, schema: str, node: str) -> dict[str, str]:
    return {
        "SESSIONCACHE_REDIS_URL": redis_url,
        "SESSIONCACHE_REDIS_PREFIX": prefix,
        "SESSIONCACHE_DATABASE_URL": PG_URL,
        "SESSIONCACHE_DATABASE_SCHEMA": schema,
        "SESSIONCACHE_NODE_ID": node,
        "SESSIONCACHE_FLEET_TTL_S": "5",
    }


def start_nodes(
    tmp_path: Path, redis_url: str, prefix: str, schema: str, names: list[str]
) -> list[Server]:
    servers: list[Server] = []
    try:
        for name in names:
            servers.append(
                start_server(tmp_path / name / "data", fleet_env(redis_url, prefix, schema, name))
            )
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, n)]


def share_and_continue(a: Server, b: Server) -> None:
    toks = tokens(1, 16 * 10)
    with (
        httpx.Client(base_url=a.url, timeout=30) as ca,
        httpx.Client(base_url=b.url, timeout=30) as cb,
    ):
        sid = ca.post("/v1/sessions", json={"kind": "agent"}).json()["id"]
        plan = ca.post("/v1/store", json={"namespace": NS, "tokens": toks, "session_id": sid})
        for i, h in enumerate(plan.json()["missing"]):
            assert ca.put(f"/v1/blocks/{h}", content=bytes([i]) * 4096).status_code == 200
        hashes = plan.json()["hashes"]
        # B never saw this chain: it finds it in the shared tier, for the same session.
        out = cb.post(
            "/v1/lookup",
            json={"namespace": NS, "tokens": toks, "session_id": sid, "locations": True},
        )
        assert out.status_code == 200, out.text
        body = out.json()
        assert body["matched_blocks"] == 10
        assert [blk["hash"] for blk in body["blocks"]] == hashes
        deadline = time.monotonic() + 5
        while not all("a" in loc for loc in body["locations"]) and time.monotonic() < deadline:
            time.sleep(0.1)  # A publishes its holdings from a background thread
            body = cb.post(
                "/v1/lookup", json={"namespace": NS, "tokens": toks, "locations": True}
            ).json()
        assert all("a" in loc for loc in body["locations"]), body["locations"]
        batch = cb.post("/v1/blocks/batch", json={"hashes": hashes})
        from sessioncache.dataplane.frames.batch import decode_batch

        assert [v for _, v in decode_batch(batch.content)] == [bytes([i]) * 4096 for i in range(10)]
        # The session continues on B: its turn extends the chain there.
        longer = toks + tokens(2, 16 * 2)
        plan_b = cb.post("/v1/store", json={"namespace": NS, "tokens": longer, "session_id": sid})
        assert plan_b.status_code == 200, plan_b.text
        assert plan_b.json()["missing"] == plan_b.json()["hashes"][10:]
        for h in plan_b.json()["missing"]:
            assert cb.put(f"/v1/blocks/{h}", content=b"\xbb" * 4096).status_code == 200
        session = cb.get(f"/v1/sessions/{sid}").json()
        assert session["head"] == plan_b.json()["hashes"][-1]
        back_on_a = ca.post("/v1/lookup", json={"namespace": NS, "tokens": longer})
        assert back_on_a.json()["matched_blocks"] == 12


def fleet_on_the_dashboard(a: Server) -> None:
    """Node A's dashboard lists both nodes of the fleet index, healthy (open local mode: no
    admin token needed), and /metrics counts them."""
    with httpx.Client(base_url=a.url, timeout=30) as c:
        fleet = c.get("/admin/api/overview").json()["fleet"]
        assert [(n["node_id"], n["healthy"], n["self"]) for n in fleet["nodes"]] == [
            ("a", True, True),
            ("b", True, False),
        ]
        assert "sessioncache_fleet_nodes 2.0" in c.get("/metrics").text


def test_two_nodes_share_blocks_and_sessions(tmp_path: Path, schema: str) -> None:
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    nodes = start_nodes(tmp_path, "redis://127.0.0.1:6379/0", prefix, schema, ["a", "b"])
    try:
        share_and_continue(nodes[0], nodes[1])
        fleet_on_the_dashboard(nodes[0])
    finally:
        for node in nodes:
            node.stop()
        client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)


def test_two_nodes_share_over_a_redis_cluster(tmp_path: Path, schema: str) -> None:
    cluster: Any = _support().RedisClusterProcs(tmp_path / "cluster", masters=3).start()
    try:
        nodes = start_nodes(tmp_path, cluster.url, "sc:", schema, ["a", "b"])
        try:
            share_and_continue(nodes[0], nodes[1])
        finally:
            for node in nodes:
                node.stop()
    finally:
        cluster.stop()


def test_redis_stopped_mid_load_and_restarted(tmp_path: Path, schema: str) -> None:
    server: Any = _support().RedisServer(tmp_path / "redis").start()
    node = start_server(tmp_path / "n" / "data", fleet_env(server.url, "sc:", schema, "n"))
    failures: list[str] = []
    done = threading.Event()
    lookups = [0]

    def load() -> None:
        with httpx.Client(base_url=node.url, timeout=30) as c:
            i = 0
            while not done.is_set():
                toks = tokens(100 + i % 20, 16 * 4)
                i += 1
                r = c.post("/v1/lookup", json={"namespace": NS, "tokens": toks})
                if r.status_code != 200:
                    failures.append(f"lookup {r.status_code}: {r.text}")
                plan = c.post("/v1/store", json={"namespace": NS, "tokens": toks})
                if plan.status_code != 200:
                    failures.append(f"store {plan.status_code}: {plan.text}")
                    continue
                for h in plan.json()["missing"]:
                    p = c.put(f"/v1/blocks/{h}", content=b"\x01" * 2048)
                    if p.status_code != 200:
                        failures.append(f"put {p.status_code}: {p.text}")
                lookups[0] += 1

    worker = threading.Thread(target=load)
    worker.start()
    try:
        time.sleep(1.0)
        server.stop()
        time.sleep(1.5)
        with httpx.Client(base_url=node.url, timeout=10) as c:
            ready = c.get("/readyz").json()
            assert ready["status"] == "degraded" and ready["problems"], ready
            assert "sessioncache_degraded 1.0" in c.get("/metrics").text
            overview = c.get("/admin/api/overview")  # the dashboard says so, without failing
            assert overview.status_code == 200 and overview.json()["problems"], overview.text
        served_while_down = lookups[0]
        server.restart()
        restarted = time.monotonic()
        with httpx.Client(base_url=node.url, timeout=10) as c:
            while c.get("/readyz").json()["status"] != "ready":
                assert time.monotonic() - restarted < 5, c.get("/readyz").json()
                time.sleep(0.1)
        time.sleep(0.5)
    finally:
        done.set()
        worker.join(30)
        node.stop()
        server.stop()
    assert not failures, failures[:5]
    assert lookups[0] > served_while_down > 0
