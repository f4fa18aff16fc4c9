"""The v1 API over HTTP against a real uvicorn process."""

from __future__ import annotations

import base64
import uuid

import httpx
import numpy as np
import pytest

from sessioncache.dataplane.frames.batch import BATCH_MEDIA_TYPE, decode_batch
from sessioncache.hashing import Namespace, block_hashes

NS = {"model": "test-model", "block_tokens": 16, "kv_dtype": "float16", "kv_layout": "test"}
BLOCK = 4096


def unique_ns() -> dict[str, object]:
    """Each test its own model name: tests share one server but never each other's blocks."""
    return {**NS, "model": f"test-model-{uuid.uuid4().hex}"}


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 100_000, n)]


def payload(hex_id: str) -> bytes:
    return (bytes.fromhex(hex_id) * (BLOCK // 16))[:BLOCK]


def store_all(
    client: httpx.Client, ns: dict[str, object], toks: list[int], **extra: object
) -> list[str]:
    plan = client.post("/v1/store", json={"namespace": ns, "tokens": toks, **extra})
    assert plan.status_code == 200, plan.text
    body = plan.json()
    for h in body["missing"]:
        r = client.put(
            f"/v1/blocks/{h}",
            content=payload(h),
            headers={"content-type": "application/octet-stream"},
        )
        assert r.status_code == 200, r.text
        # answered once memory holds it: its disk copy follows (write-behind)
        assert r.json() == {"hash": h, "stored": True, "status": "stored", "durable": False}
    hashes: list[str] = body["hashes"]
    return hashes


def test_ids_match_the_spec_and_only_missing_blocks_travel(client: httpx.Client):
    ns = unique_ns()
    toks = tokens(1, 100)
    hashes = store_all(client, ns, toks)
    expected = block_hashes(Namespace(**ns), toks)  # type: ignore[arg-type]
    assert hashes == [h.hex() for h in expected] and len(hashes) == 6
    again = client.post("/v1/store", json={"namespace": ns, "tokens": toks + tokens(2, 16)}).json()
    assert again["missing"] == again["hashes"][6:] and len(again["hashes"]) == 7


def test_lookup_json_and_binary_tokens_agree(client: httpx.Client):
    ns = unique_ns()
    toks = tokens(3, 64)
    hashes = store_all(client, ns, toks)
    longer = toks + tokens(4, 40)
    b64 = base64.b64encode(np.asarray(longer, dtype="<u4").tobytes()).decode()
    for body in ({"tokens": longer}, {"tokens_b64": b64}):
        r = client.post("/v1/lookup", json={"namespace": ns, **body})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["block_tokens"] == 16 and out["matched_blocks"] == 4
        assert out["matched_tokens"] == 64 and out["lease"] is None
        assert [b["hash"] for b in out["blocks"]] == hashes
        assert {b["tier"] for b in out["blocks"]} == {"cpu"}


def test_lease_and_release(client: httpx.Client):
    ns = unique_ns()
    toks = tokens(5, 32)
    store_all(client, ns, toks)
    out = client.post("/v1/lookup", json={"namespace": ns, "tokens": toks, "lease_ms": 5000}).json()
    lease = out["lease"]
    assert lease["id"] and lease["expires_at"] > 0
    assert client.delete(f"/v1/leases/{lease['id']}").status_code == 204
    r = client.delete(f"/v1/leases/{lease['id']}")
    assert r.status_code == 404 and r.json()["error"] == "LeaseNotFound"


def test_get_single_and_batch_blocks_byte_exact(client: httpx.Client):
    ns = unique_ns()
    hashes = store_all(client, ns, tokens(6, 48))
    r = client.get(f"/v1/blocks/{hashes[1]}")
    assert r.status_code == 200 and r.content == payload(hashes[1])
    assert r.headers["content-type"] == "application/octet-stream"
    unknown = "ab" * 16
    r = client.post("/v1/blocks/batch", json={"hashes": [*hashes, unknown]})
    assert r.status_code == 200 and r.headers["content-type"] == BATCH_MEDIA_TYPE
    records = decode_batch(r.content)
    assert [k.hex() for k, _ in records] == [*hashes, unknown]
    assert [v for _, v in records] == [*(payload(h) for h in hashes), None]


def test_put_of_an_id_not_handed_out_is_rejected(client: httpx.Client):
    ns = unique_ns()
    toks = tokens(7, 16)
    forged = block_hashes(Namespace(**ns), toks)[0].hex()  # type: ignore[arg-type]
    r = client.put(f"/v1/blocks/{forged}", content=b"x" * BLOCK)
    assert r.status_code == 403 and r.json()["error"] == "UploadRefused"
    hashes = store_all(client, ns, toks)
    r = client.put(f"/v1/blocks/{hashes[0]}", content=b"y" * BLOCK)  # other bytes, held id
    assert r.status_code == 403 and r.json()["error"] == "UploadRefused"
    assert client.get(f"/v1/blocks/{hashes[0]}").content == payload(hashes[0])


def test_a_retried_put_of_the_same_bytes_succeeds_without_storing_twice(client: httpx.Client):
    """A client whose first answer was lost sends the PUT again (issue 8, bug 2)."""
    ns = unique_ns()
    hashes = store_all(client, ns, tokens(17, 32))
    stats = client.get("/v1/stats").json()
    for h in hashes:
        r = client.put(f"/v1/blocks/{h}", content=payload(h))
        assert r.status_code == 200, r.text
        assert r.json()["stored"] is False
    assert (
        client.get("/v1/stats").json()["counters"]["stored_blocks"]
        == (stats["counters"]["stored_blocks"])
    )
    out = client.post("/v1/lookup", json={"namespace": ns, "tokens": tokens(17, 32)}).json()
    assert out["matched_blocks"] == 2
    # Another caller (another tenant's key would be refused too) never had the slot.
    other = unique_ns()
    forged = block_hashes(Namespace(**other), tokens(17, 16))[0].hex()  # type: ignore[arg-type]
    assert client.put(f"/v1/blocks/{forged}", content=payload(forged)).status_code == 403


def test_payload_of_the_wrong_size_is_rejected_and_nothing_written(client: httpx.Client):
    ns = unique_ns()
    store_all(client, ns, tokens(8, 16))
    plan = client.post("/v1/store", json={"namespace": ns, "tokens": tokens(9, 16)}).json()
    h = plan["missing"][0]
    r = client.put(f"/v1/blocks/{h}", content=b"z" * (BLOCK + 1))
    assert r.status_code == 422 and r.json()["error"] == "PayloadSizeError"
    assert client.get(f"/v1/blocks/{h}").status_code == 404


@pytest.mark.parametrize(
    ("method", "path", "kwargs"),
    [
        ("post", "/v1/lookup", {"content": b"{not json"}),
        ("post", "/v1/lookup", {"json": {"namespace": NS}}),
        ("post", "/v1/lookup", {"json": {"namespace": NS, "tokens": [1], "tokens_b64": "AAAA"}}),
        ("post", "/v1/lookup", {"json": {"namespace": NS, "tokens": [-1]}}),
        ("post", "/v1/lookup", {"json": {"namespace": NS, "tokens": [2**32]}}),
        ("post", "/v1/lookup", {"json": {"namespace": NS, "tokens": ["a"]}}),
        ("post", "/v1/lookup", {"json": {"namespace": NS, "tokens_b64": "###"}}),
        ("post", "/v1/lookup", {"json": {"namespace": NS, "tokens_b64": "AAA="}}),
        ("post", "/v1/lookup", {"json": {"namespace": {**NS, "block_tokens": 0}, "tokens": [1]}}),
        ("post", "/v1/lookup", {"json": {"namespace": {**NS, "extra": 1}, "tokens": [1]}}),
        ("post", "/v1/lookup", {"json": {"namespace": NS, "tokens": [1], "lease_ms": -5}}),
        ("post", "/v1/lookup", {"json": {"namespace": NS, "tokens": [1], "session_id": "nope"}}),
        ("post", "/v1/store", {"json": {"namespace": NS, "tokens": [1], "ttl_s": 0}}),
        ("get", "/v1/blocks/xyz", {}),
        ("get", "/v1/blocks/" + "cd" * 16, {}),
        ("put", "/v1/blocks/" + "cd" * 16, {"content": b""}),
        ("put", "/v1/blocks/" + "cd" * 16, {"content": b"x" * (9 << 20)}),
        ("post", "/v1/blocks/batch", {"json": {"hashes": []}}),
        ("post", "/v1/blocks/batch", {"json": {"hashes": ["nothex"]}}),
        ("get", "/v1/sessions/unknown", {}),
        ("post", "/v1/sessions", {"json": {"kind": "batch"}}),
        ("post", "/v1/sessions", {"json": {"session_id": "a/b"}}),
        ("delete", "/v1/sessions/unknown", {}),
        ("delete", "/v1/leases/unknown", {}),
        ("get", "/v1/nothing-here", {}),
    ],
)
def test_bad_input_gets_a_4xx_json_error(
    client: httpx.Client, method: str, path: str, kwargs: dict[str, object]
):
    r = getattr(client, method)(path, **kwargs)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error", "detail"} and body["detail"]


def test_sessions_lifecycle(client: httpx.Client):
    sid = f"s-{uuid.uuid4().hex}"
    r = client.post("/v1/sessions", json={"session_id": sid, "kind": "chat"})
    assert r.status_code == 201 and r.json()["ttl_s"] == 7 * 86400
    ns = unique_ns()
    toks = tokens(10, 48)
    hashes = store_all(client, ns, toks, session_id=sid)
    got = client.get(f"/v1/sessions/{sid}").json()
    assert got["head"] == hashes[-1] and got["pinned"] is True and got["kind"] == "chat"
    out = client.post("/v1/lookup", json={"namespace": ns, "tokens": toks, "session_id": sid})
    assert out.json()["matched_blocks"] == 3
    extended = client.post(f"/v1/sessions/{sid}/extend", json={"ttl_s": 100}).json()
    assert extended["ttl_s"] == 100
    assert sid in [s["id"] for s in client.get("/v1/sessions").json()["sessions"]]
    assert client.delete(f"/v1/sessions/{sid}").status_code == 204
    assert client.get(f"/v1/sessions/{sid}").status_code == 404


def test_a_store_naming_a_session_counts_no_lookup(client: httpx.Client):
    """``POST /v1/store`` looks up which blocks are missing: the node's own probe, no lookup
    an engine asked for. Noting the session's chain touches those blocks again: no lookup
    either."""
    sid = f"s-{uuid.uuid4().hex}"
    assert client.post("/v1/sessions", json={"session_id": sid}).status_code == 201
    ns = unique_ns()
    toks = tokens(13, 64)
    store_all(client, ns, toks, session_id=sid)

    def counters() -> dict[str, int]:
        out: dict[str, int] = client.get("/v1/stats").json()["counters"]
        return out

    def exported_lookups() -> float:
        lines = client.get("/metrics").text.splitlines()
        return next(
            float(x.split()[1]) for x in lines if x.startswith("sessioncache_lookups_total ")
        )

    before, exported = counters(), exported_lookups()
    plan = client.post(
        "/v1/store", json={"namespace": ns, "tokens": toks + tokens(14, 32), "session_id": sid}
    ).json()
    after = counters()
    assert len(plan["missing"]) == 2
    assert after["lookups"] == before["lookups"]
    assert after["hit_blocks"] == before["hit_blocks"]
    assert exported_lookups() == exported
    assert client.get(f"/v1/sessions/{sid}").json()["pinned"] is True


def test_operations_endpoints(client: httpx.Client):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json()["status"] == "ready"
    assert client.get("/v1/whoami").json() == {"tenant": "default", "auth": False}
    stats = client.get("/v1/stats").json()
    assert {t["name"] for t in stats["tiers"]} == {"cpu", "disk"}
    metrics = client.get("/metrics")
    assert metrics.status_code == 200
    for name in (
        "sessioncache_hit_tokens_total",
        "sessioncache_tier_used_bytes",
        "sessioncache_evictions_total",
        "sessioncache_request_seconds_bucket",
    ):
        assert name in metrics.text
    spec = client.get("/openapi.json").json()
    for path in (
        "/v1/lookup",
        "/v1/store",
        "/v1/blocks/{block_hash}",
        "/v1/blocks/batch",
        "/v1/sessions",
        "/v1/sessions/{session_id}",
        "/v1/stats",
    ):
        assert path in spec["paths"]
    assert client.get("/docs").status_code == 200
