"""``POST /v1/gc`` against a real server: what one sweep expires, unpins and reports."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import httpx
import numpy as np

from tests.support.servers import start_server

KEY = "key-ops"
ADMIN_KEY = "key-admin"
BLOCK_TOKENS = 16
BLOCK = 4096


def tokens(seed: int, blocks: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, 100_000, blocks * BLOCK_TOKENS)]


def store(client: httpx.Client, ns: dict[str, object], toks: list[int], **extra: object) -> None:
    plan = client.post("/v1/store", json={"namespace": ns, "tokens": toks, **extra})
    assert plan.status_code == 200, plan.text
    for h in plan.json()["missing"]:
        r = client.put(
            f"/v1/blocks/{h}",
            content=bytes.fromhex(h) * (BLOCK // 16),
            headers={"content-type": "application/octet-stream"},
        )
        assert r.status_code == 200, r.text


def matched(client: httpx.Client, ns: dict[str, object], toks: list[int]) -> int:
    r = client.post("/v1/lookup", json={"namespace": ns, "tokens": toks})
    assert r.status_code == 200, r.text
    count: int = r.json()["matched_blocks"]
    return count


def test_gc_expires_sessions_and_blocks_and_unpins_idle_sessions(tmp_path: Path):
    server = start_server(
        tmp_path / "data",
        {
            "SESSIONCACHE_API_KEYS": json.dumps({KEY: "ops"}),
            "SESSIONCACHE_ADMIN_TOKEN": ADMIN_KEY,
            "SESSIONCACHE_SWEEP_INTERVAL_S": "3600",  # no background sweep: only POST /v1/gc
            "SESSIONCACHE_IDLE_TIMEOUT_S": "1",
        },
    )
    try:
        assert httpx.post(f"{server.url}/v1/gc").status_code == 401
        headers = {"authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=30) as client:
            ns = {
                "model": f"gc-{uuid.uuid4().hex}",
                "block_tokens": BLOCK_TOKENS,
                "kv_dtype": "float16",
                "kv_layout": "test",
            }
            brief = client.post("/v1/sessions", json={"session_id": "brief", "ttl_s": 1})
            assert brief.status_code == 201
            assert client.post("/v1/sessions", json={"session_id": "idle"}).status_code == 201
            chain, short, lasting = tokens(1, 2), tokens(2, 3), tokens(3, 2)
            store(client, ns, chain, session_id="idle")
            assert client.get("/v1/sessions/idle").json()["pinned"] is True
            store(client, ns, short, ttl_s=1)
            store(client, ns, lasting)
            assert client.get("/v1/stats").json()["blocks"] == 2 + 3 + 2
            time.sleep(1.3)  # past the 1 s TTLs and the 1 s idle timeout

            assert client.post("/v1/gc").status_code == 403  # a tenant's key: not an admin's
            r = client.post("/v1/gc", headers={"authorization": f"Bearer {ADMIN_KEY}"})
            assert r.status_code == 200
            assert r.json() == {"expired_sessions": 1, "idle_unpinned": 1, "expired_blocks": 3}

            assert client.get("/v1/sessions/brief").status_code == 404
            idle = client.get("/v1/sessions/idle").json()
            assert idle["pinned"] is False  # still open: its TTL is days
            assert [matched(client, ns, t) for t in (chain, short, lasting)] == [2, 0, 2]
            assert client.get("/v1/stats").json()["blocks"] == 4
            # Nothing left to do.
            again = client.post("/v1/gc", headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()
            assert again == {"expired_sessions": 0, "idle_unpinned": 0, "expired_blocks": 0}
    finally:
        server.stop()
