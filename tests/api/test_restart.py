"""``kill -9`` the service and start it again on the same data dir: every acknowledged block
and session is still there and hits, with the chain and the expiry it had."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import numpy as np

from tests.support.servers import DURABLE_NODE, Server, start_server

NS = {"model": "restart-model", "block_tokens": 16, "kv_dtype": "bf16", "kv_layout": "x"}


def kill_9(server: Server) -> None:
    server.process.send_signal(signal.SIGKILL)
    assert server.process.wait(10) == -signal.SIGKILL  # it died of the kill, not before


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 1000, n)]


def test_kill_9_and_restart_keeps_acknowledged_blocks_and_sessions(tmp_path: Path):
    data = tmp_path / "data"
    server = start_server(data, DURABLE_NODE)
    toks = tokens(1, 16 * 12)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            sid = c.post("/v1/sessions", json={"kind": "chat"}).json()["id"]
            plan = c.post("/v1/store", json={"namespace": NS, "tokens": toks, "session_id": sid})
            hashes = plan.json()["hashes"]
            for i, h in enumerate(plan.json()["missing"]):
                r = c.put(f"/v1/blocks/{h}", content=bytes([i]) * 2048)
                assert r.json()["durable"] is True
            before = c.get(f"/v1/sessions/{sid}").json()
            assert before["head"] == hashes[-1]
            # A session's activity (its head) is written behind, within the flush interval
            # (0.2 s); only its creation is durable at once (docs/sessions.md).
            time.sleep(1.0)
    finally:
        kill_9(server)
    server = start_server(data, DURABLE_NODE)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            session = c.get(f"/v1/sessions/{sid}")
            assert session.status_code == 200, session.text
            after = session.json()
            for key in ("kind", "ttl_s", "head", "created"):
                assert after[key] == before[key], key
            assert after["expires_at"] >= before["expires_at"]
            out = c.post("/v1/lookup", json={"namespace": NS, "tokens": toks, "session_id": sid})
            assert out.json()["matched_blocks"] == 12
            assert [b["hash"] for b in out.json()["blocks"]] == hashes
            for i, block in enumerate(out.json()["blocks"]):
                assert c.get(f"/v1/blocks/{block['hash']}").content == bytes([i]) * 2048
    finally:
        server.stop()


def test_blocks_that_expired_while_the_node_was_down_miss_after_a_restart(tmp_path: Path):
    """Issue 8, bug 1, as a user tried it: blocks stored with a TTL of 2 s, the node killed,
    restarted after they expired: they miss, and a sweep frees them."""
    data = tmp_path / "data"
    server = start_server(data, {"SESSIONCACHE_CATALOG_FLUSH_INTERVAL_S": "0.05"})
    short, lasting = tokens(2, 16 * 3), tokens(3, 16 * 3)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for toks, ttl in ((short, 2.0), (lasting, 3600.0)):
                plan = c.post("/v1/store", json={"namespace": NS, "tokens": toks, "ttl_s": ttl})
                for h in plan.json()["missing"]:
                    assert c.put(f"/v1/blocks/{h}", content=b"\x07" * 2048).status_code == 200
            time.sleep(0.5)  # the catalog's write-behind batch lands
    finally:
        kill_9(server)
    time.sleep(2.5)
    server = start_server(data, DURABLE_NODE)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            lookup = {"namespace": NS, "tokens": short}
            assert c.post("/v1/lookup", json=lookup).json()["matched_blocks"] == 0
            lookup = {"namespace": NS, "tokens": lasting}
            assert c.post("/v1/lookup", json=lookup).json()["matched_blocks"] == 3
            assert c.post("/v1/gc").json()["expired_blocks"] == 3
    finally:
        server.stop()
