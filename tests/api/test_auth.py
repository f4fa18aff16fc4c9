"""API keys map to tenants; a tenant can never read, hit or overwrite another's blocks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from sessioncache.hashing import Namespace, block_hashes
from tests.api.conftest import KEYS
from tests.support.servers import Server, start_server

NS = {"model": "auth-model", "block_tokens": 8, "kv_dtype": "bf16", "kv_layout": "x"}
TOKS = [int(t) for t in np.random.default_rng(0).integers(0, 1000, 32)]


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture
def acme(auth_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=auth_server.url, headers={"authorization": "Bearer key-acme"}, timeout=30
    ) as c:
        yield c


@pytest.fixture
def globex(auth_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=auth_server.url, headers={"authorization": "Bearer key-globex"}, timeout=30
    ) as c:
        yield c


def test_missing_or_unknown_key_is_401(auth_server: Server):
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic a2V5"}):
        r = httpx.post(
            f"{auth_server.url}/v1/lookup", json={"namespace": NS, "tokens": TOKS}, headers=headers
        )
        assert r.status_code == 401 and r.json()["error"] == "AuthRefused"
    assert httpx.get(f"{auth_server.url}/healthz").status_code == 200


def test_whoami(acme: httpx.Client, globex: httpx.Client):
    assert acme.get("/v1/whoami").json() == {"tenant": "acme", "auth": True}
    assert globex.get("/v1/whoami").json() == {"tenant": "globex", "auth": True}


def test_salt_is_derived_from_the_tenant(acme: httpx.Client):
    hashes = acme.post("/v1/store", json={"namespace": NS, "tokens": TOKS}).json()["hashes"]
    expected = block_hashes(Namespace(**{**NS, "salt": "acme"}), TOKS)  # type: ignore[arg-type]
    assert hashes == [h.hex() for h in expected]
    salted = acme.post(
        "/v1/store", json={"namespace": {**NS, "salt": "team-1"}, "tokens": TOKS}
    ).json()["hashes"]
    expected = block_hashes(Namespace(**{**NS, "salt": "acme/team-1"}), TOKS)  # type: ignore[arg-type]
    assert salted == [h.hex() for h in expected]


def test_tenants_are_isolated(acme: httpx.Client, globex: httpx.Client):
    plan = acme.post("/v1/store", json={"namespace": NS, "tokens": TOKS}).json()
    for h in plan["missing"]:
        assert acme.put(f"/v1/blocks/{h}", content=b"A" * 64).status_code == 200
    assert (
        acme.post("/v1/lookup", json={"namespace": NS, "tokens": TOKS}).json()["matched_blocks"]
        == 4
    )
    # globex, same tokens and even acme's salt spelled out: no hit, no read, no overwrite
    for ns in (NS, {**NS, "salt": "acme"}):
        out = globex.post("/v1/lookup", json={"namespace": ns, "tokens": TOKS}).json()
        assert out["matched_blocks"] == 0
    for h in plan["hashes"]:
        assert globex.get(f"/v1/blocks/{h}").status_code == 404
        assert globex.put(f"/v1/blocks/{h}", content=b"G" * 64).status_code == 403
    batch = globex.post("/v1/blocks/batch", json={"hashes": plan["hashes"]})
    assert batch.status_code == 200 and b"A" * 64 not in batch.content
    for h in plan["hashes"]:
        assert acme.get(f"/v1/blocks/{h}").content == b"A" * 64


def test_sessions_are_per_tenant(acme: httpx.Client, globex: httpx.Client):
    sid = acme.post("/v1/sessions", json={}).json()["id"]
    assert globex.get(f"/v1/sessions/{sid}").status_code == 404
    assert globex.delete(f"/v1/sessions/{sid}").status_code == 404
    assert sid not in [s["id"] for s in globex.get("/v1/sessions").json()["sessions"]]
    assert acme.get(f"/v1/sessions/{sid}").status_code == 200


def test_a_tenant_reads_its_blocks_after_a_restart_before_any_lookup(tmp_path: Path):
    """Ownership of namespace roots is kept in the catalog: after a restart a tenant's first
    request may be a block read, and another tenant still cannot read it."""
    env = {"SESSIONCACHE_API_KEYS": json.dumps(KEYS)}
    server = start_server(tmp_path / "data", env)
    try:
        with httpx.Client(base_url=server.url, headers=bearer("key-acme"), timeout=30) as c:
            plan = c.post("/v1/store", json={"namespace": NS, "tokens": TOKS}).json()
            for h in plan["missing"]:
                assert c.put(f"/v1/blocks/{h}", content=b"\x05" * 1024).status_code == 200
    finally:
        server.stop()
    server = start_server(tmp_path / "data", env)
    try:
        with httpx.Client(base_url=server.url, headers=bearer("key-globex"), timeout=30) as c:
            assert c.get(f"/v1/blocks/{plan['hashes'][0]}").status_code == 404
        with httpx.Client(base_url=server.url, headers=bearer("key-acme"), timeout=30) as c:
            r = c.get(f"/v1/blocks/{plan['hashes'][0]}")
            assert r.status_code == 200 and r.content == b"\x05" * 1024
    finally:
        server.stop()
