"""``/readyz`` for load balancers: a degraded node keeps serving (200) unless asked strictly."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.support.servers import free_port, start_server


def test_a_degraded_node_is_ready_but_not_strictly_ready(tmp_path: Path):
    # A shared tier nobody listens on: the node starts degraded and serves from local tiers.
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    server = start_server(tmp_path / "data", {"SESSIONCACHE_REDIS_URL": dead_redis})
    try:
        with httpx.Client(base_url=server.url, timeout=10) as c:
            plain = c.get("/readyz")
            assert plain.status_code == 200, plain.text
            assert plain.json()["status"] == "degraded" and plain.json()["problems"]
            needs = plain.json()["dependencies"]
            assert needs["catalog"] == "ok" and needs["disk"] == "ok", needs
            assert needs["redis"] != "ok" and needs["fleet index"] != "ok", needs
            strict = c.get("/readyz", params={"strict": "true"})
            assert strict.status_code == 503, strict.text
            assert strict.json()["status"] == "degraded"
    finally:
        server.stop()


def test_a_healthy_node_is_strictly_ready(tmp_path: Path):
    server = start_server(tmp_path / "data")
    try:
        with httpx.Client(base_url=server.url, timeout=10) as c:
            for params in ({}, {"strict": "true"}):
                r = c.get("/readyz", params=params)
                assert r.status_code == 200, r.text
                assert r.json() == {
                    "status": "ready",
                    "problems": [],
                    "dependencies": {"catalog": "ok", "disk": "ok"},
                }
            assert c.get("/readyz", params={"strict": "maybe"}).status_code == 422
    finally:
        server.stop()
