"""``kill -9`` the service and start it again on the same data dir: every acknowledged block
and session is still there and hits."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import numpy as np

from tests.support.servers import start_server

NS = {"model": "restart-model", "block_tokens": 16, "kv_dtype": "bf16", "kv_layout": "x"}


def test_kill_9_and_restart_keeps_acknowledged_blocks_and_sessions(tmp_path: Path):
    data = tmp_path / "data"
    server = start_server(data)
    toks = [int(t) for t in np.random.default_rng(1).integers(0, 1000, 16 * 12)]
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            sid = c.post("/v1/sessions", json={"kind": "agent"}).json()["id"]
            plan = c.post("/v1/store", json={"namespace": NS, "tokens": toks, "session_id": sid})
            for i, h in enumerate(plan.json()["missing"]):
                r = c.put(f"/v1/blocks/{h}", content=bytes([i]) * 2048)
                assert r.json()["durable"] is True
    finally:
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(10)
    server = start_server(data)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            session = c.get(f"/v1/sessions/{sid}")
            assert session.status_code == 200, session.text
            out = c.post("/v1/lookup", json={"namespace": NS, "tokens": toks, "session_id": sid})
            assert out.json()["matched_blocks"] == 12
            for i, block in enumerate(out.json()["blocks"]):
                assert c.get(f"/v1/blocks/{block['hash']}").content == bytes([i]) * 2048
    finally:
        server.stop()
