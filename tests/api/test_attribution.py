"""Miss attribution through the REST API, on a node whose clock the test moves
(``ManualClock``): sessions edited in the middle, idle past their TTL, squeezed out, fresh."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from sessioncache.api.app import create_app
from sessioncache.clock import ManualClock
from sessioncache.config import Settings
from sessioncache.factory import open_node

NS = {"model": "attr-model", "block_tokens": 16, "kv_dtype": "float16", "kv_layout": "test"}
BT = 16
BLOCK = 4096


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 100_000, n)]


def make_client(tmp_path: Path, clock: ManualClock, **settings: Any) -> Iterator[TestClient]:
    node = open_node(Settings(data_dir=tmp_path / "data", **settings), clock=clock, start=False)
    with TestClient(create_app(node), base_url="http://127.0.0.1") as client:
        yield client


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def client(tmp_path: Path, clock: ManualClock) -> Iterator[TestClient]:
    yield from make_client(tmp_path, clock, cpu_bytes=64 * BLOCK, disk_bytes=0)


def store(
    client: TestClient, toks: list[int], session: str | None = None, **headers: str
) -> list[str]:
    body: dict[str, Any] = {"namespace": NS, "tokens": toks}
    if session is not None:
        body["session_id"] = session
    plan = client.post("/v1/store", json=body, headers=headers)
    assert plan.status_code == 200, plan.text
    for h in plan.json()["missing"]:
        r = client.put(f"/v1/blocks/{h}", content=bytes.fromhex(h) * (BLOCK // 16), headers=headers)
        assert r.status_code == 200, r.text
    hashes: list[str] = plan.json()["hashes"]
    behind = client.app.state.node.store.write_behind  # type: ignore[attr-defined]
    if behind is not None:  # on disk before the next store: evictions in a set order
        assert behind.flush(30)
    return hashes


def lookup(
    client: TestClient, toks: list[int], session: str | None = None, **headers: str
) -> dict[str, Any]:
    body: dict[str, Any] = {"namespace": NS, "tokens": toks, "explain": True, "compact": True}
    if session is not None:
        body["session_id"] = session
    r = client.post("/v1/lookup", json=body, headers=headers)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    miss = out["miss"]
    assert sum(miss["tokens"].values()) == len(toks) - out["matched_tokens"]
    return out


def open_session(client: TestClient, sid: str, **extra: Any) -> None:
    headers = extra.pop("headers", {})
    r = client.post("/v1/sessions", json={"session_id": sid, **extra}, headers=headers)
    assert r.status_code == 201, r.text


def metric(client: TestClient, name: str) -> dict[str, float]:
    """``{labels: value}`` of one metric in ``/metrics``."""
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, value = line.rpartition(" ")
            out[key[len(name) :]] = float(value)
    return out


def test_a_prompt_edited_in_the_middle_diverges_at_that_block_and_offset(client: TestClient):
    open_session(client, "edit")
    first = tokens(1, 10 * BT)
    store(client, first, "edit")
    edited = list(first)
    edited[4 * BT + 13] += 1  # block 4, token 13 inside it
    grown = edited + tokens(2, 2 * BT + 5)
    out = lookup(client, grown, "edit")
    miss = out["miss"]
    assert out["matched_blocks"] == 4
    assert miss["reason"] == "diverged" and miss["block"] == 4 and miss["offset"] == 13
    assert miss["token"] == 4 * BT + 13
    # blocks 4..9 were cached and are unusable; the 2 blocks and 5 tokens past them are growth
    assert miss["tokens"] == {
        "diverged": 6 * BT,
        "evicted": 0,
        "expired": 0,
        "new": 2 * BT + 5,
        "declined": 0,
    }
    session = client.get("/v1/sessions/edit").json()
    attribution = session["attribution"]
    div = attribution["last_divergence"]
    assert (div["block"], div["offset"], div["token"], div["lost_blocks"]) == (4, 13, 77, 6)
    assert attribution["hit_tokens"] == 4 * BT and attribution["lookups"] == 1
    assert attribution["miss_tokens"] == miss["tokens"]


def test_ids_only_give_the_block_without_the_offset(client: TestClient):
    open_session(client, "ids")
    first = tokens(3, 6 * BT)
    hashes = store(client, first, "ids")
    ids = [bytes.fromhex(h) for h in hashes[:2]]
    other = store(client, first[: 2 * BT] + tokens(4, 4 * BT))  # another tail, no session
    ids += [bytes.fromhex(h) for h in other[2:]]
    body = {
        "namespace": NS,
        "block_ids_b64": base64.b64encode(b"".join(ids)).decode(),
        "session_id": "ids",
        "explain": True,
    }
    out = client.post("/v1/lookup", json=body).json()
    # the other tail is held: a divergence that still hits; nothing missed
    assert out["matched_blocks"] == 6 and out["miss"]["reason"] is None
    div = client.get("/v1/sessions/ids").json()["attribution"]["last_divergence"]
    assert div["block"] == 2 and div["offset"] is None and div["lost_blocks"] == 4


def test_a_session_idle_past_its_ttl_misses_as_expired(client: TestClient, clock: ManualClock):
    open_session(client, "idle", ttl_s=600)
    toks = tokens(5, 8 * BT)
    store(client, toks, "idle")
    clock.advance(1000)
    # not swept yet: the blocks are still held, expired for 400 s
    out = lookup(client, toks + tokens(6, BT))
    miss = out["miss"]
    assert miss["reason"] == "expired" and miss["block"] == 0
    assert miss["ago_s"] == pytest.approx(400)
    assert miss["tokens"] == {
        "diverged": 0,
        "evicted": 0,
        "expired": 8 * BT,
        "new": BT,
        "declined": 0,
    }
    assert client.post("/v1/gc").json()["expired_sessions"] == 1
    clock.advance(50)
    open_session(client, "idle", ttl_s=600)  # the agent comes back: a new session
    miss = lookup(client, toks, "idle")["miss"]
    assert miss["reason"] == "expired" and miss["tier"] == "cpu"
    assert miss["ago_s"] == pytest.approx(450)
    assert miss["tokens"]["expired"] == 8 * BT


def test_a_fresh_conversation_is_new(client: TestClient):
    open_session(client, "fresh")
    toks = tokens(7, 3 * BT + 7)
    miss = lookup(client, toks, "fresh")["miss"]
    assert miss["reason"] == "new" and miss["block"] == 0 and miss["tier"] is None
    assert miss["tokens"] == {
        "diverged": 0,
        "evicted": 0,
        "expired": 0,
        "new": 3 * BT + 7,
        "declined": 0,
    }
    # the normal turn: stored, then grown: only the growth misses, as new
    store(client, toks, "fresh")
    out = lookup(client, toks + tokens(8, 2 * BT), "fresh")
    assert out["matched_blocks"] == 3
    assert out["miss"]["reason"] == "new" and out["miss"]["block"] == 3
    attribution = client.get("/v1/sessions/fresh").json()["attribution"]
    assert attribution["last_divergence"] is None


def test_without_explain_no_miss_in_the_answer(client: TestClient):
    r = client.post("/v1/lookup", json={"namespace": NS, "tokens": tokens(9, 40)})
    assert r.status_code == 200 and r.json().get("miss") is None


@pytest.fixture
def tiered(tmp_path: Path, clock: ManualClock) -> Iterator[TestClient]:
    # 8 blocks of CPU over 8 of disk; pins may hold half of each (the one tenant all of it)
    yield from make_client(
        tmp_path,
        clock,
        cpu_bytes=8 * BLOCK,
        disk_bytes=8 * BLOCK,
        idle_timeout_s=60,
        tenant_pin_share=1.0,
    )


def test_a_capacity_squeeze_evicts_from_the_last_tier(tiered: TestClient, clock: ManualClock):
    open_session(tiered, "old")
    old = tokens(10, 4 * BT)
    store(tiered, old, "old")
    clock.advance(120)
    tiered.post("/v1/gc")  # idle: its pins go
    for seed in range(11, 15):  # 16 blocks of other work push it out of cpu, then disk
        clock.advance(1)
        store(tiered, tokens(seed, 4 * BT))
    clock.advance(30)
    miss = lookup(tiered, old, "old")["miss"]
    assert miss["reason"] == "evicted" and miss["block"] == 0
    assert miss["tier"] == "disk" and miss["pressure"] == "capacity"
    assert 30 <= miss["ago_s"] <= 33
    assert miss["tokens"]["evicted"] == 4 * BT


def test_evictions_after_the_pin_budget_dropped_the_pins(tiered: TestClient, clock: ManualClock):
    open_session(tiered, "first")
    first = tokens(20, 4 * BT)
    store(tiered, first, "first")
    # its turn ended for the user: of the pinned sessions, the one expected back last
    finished = tiered.post("/v1/sessions/first/finish", json={"finish_reason": "end_turn"})
    assert finished.status_code == 200, finished.text
    open_session(tiered, "second")
    clock.advance(1)
    # a second pinned chain overflows the pin budget: the session expected back last (under
    # SESSIONCACHE_EVICTION_POLICY=lru, the least recently active) loses its pins
    store(tiered, tokens(21, 4 * BT), "second")
    for seed in range(22, 25):
        clock.advance(1)
        store(tiered, tokens(seed, 4 * BT))
    miss = lookup(tiered, first, "first")["miss"]
    assert miss["reason"] == "evicted" and miss["pressure"] == "pin_budget"
    assert miss["tier"] == "disk"


def test_session_and_metrics_totals_add_up(client: TestClient, clock: ManualClock):
    open_session(client, "sum", ttl_s=600)
    asked = hit = 0
    base = tokens(30, 6 * BT)
    prompts = [base, base + tokens(31, BT), [*base[:40], 1, *base[41:]], base + tokens(32, 3)]
    for i, toks in enumerate(prompts):
        out = lookup(client, toks, "sum")
        asked += len(toks)
        hit += out["matched_tokens"]
        store(client, toks, "sum")
        clock.advance(700 if i == 2 else 10)
        if i == 2:
            client.post("/v1/gc")
            open_session(client, "sum", ttl_s=600)
    attribution = client.get("/v1/sessions/sum").json()["attribution"]
    # the last lookup came after the session expired and reopened: totals restart with it
    assert attribution["lookups"] == 1
    by_reason = metric(client, "sessioncache_miss_tokens_by_reason_total")
    missed = metric(client, "sessioncache_miss_tokens_total")[""]
    assert sum(by_reason.values()) == missed == asked - hit
    assert by_reason['{reason="diverged"}'] > 0 and by_reason['{reason="expired"}'] > 0


ADMIN = "admin-token-attr"


@pytest.fixture
def auth(tmp_path: Path, clock: ManualClock) -> Iterator[TestClient]:
    keys = {"key-a": "acme", "key-b": "globex"}
    yield from make_client(
        tmp_path,
        clock,
        cpu_bytes=64 * BLOCK,
        disk_bytes=0,
        api_keys=json.loads(json.dumps(keys)),
        admin_token=ADMIN,
    )


def test_tenants_see_only_their_own_attribution(auth: TestClient, clock: ManualClock):
    a = {"authorization": "Bearer key-a"}
    b = {"authorization": "Bearer key-b"}
    open_session(auth, "mine", ttl_s=100, headers=a)
    toks = tokens(40, 4 * BT)
    hashes = store(auth, toks, "mine", **a)
    lookup(auth, [*toks[:BT], 7, *toks[BT + 1 :]], "mine", **a)
    assert auth.get("/v1/sessions/mine", headers=b).status_code == 404
    assert auth.get("/v1/sessions/mine", headers=a).json()["attribution"]["lookups"] == 1
    clock.advance(200)
    assert auth.post("/v1/gc", headers={"authorization": f"Bearer {ADMIN}"}).status_code == 200
    # globex names acme's expired ids: it learns nothing of them
    body = {
        "namespace": NS,
        "block_ids_b64": base64.b64encode(b"".join(bytes.fromhex(h) for h in hashes)).decode(),
        "explain": True,
    }
    miss = auth.post("/v1/lookup", json=body, headers=b).json()["miss"]
    assert miss["reason"] == "new" and miss["ago_s"] is None
    # the same tokens under globex are globex's own ids: new to it too
    open_session(auth, "mine", headers=b)  # the id is free again: globex's own session
    assert lookup(auth, toks, "mine", **b)["miss"]["reason"] == "new"
    mine = auth.get("/v1/sessions/mine", headers=b).json()["attribution"]
    assert mine["lookups"] == 1 and mine["last_divergence"] is None


def touched(client: TestClient, hashes: list[str]) -> list[tuple[float, float, int, int]]:
    """Each block's last access, expiry, hits and references (what a lookup moves)."""
    reads = client.app.state.node.store.reads  # type: ignore[attr-defined]
    out = []
    for h in hashes:
        meta = reads.meta(bytes.fromhex(h))
        assert meta is not None
        out.append((meta.last_access, meta.expires_at, meta.hit_count, meta.ref_cnt))
    return out


def declined(client: TestClient, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    r = client.post(
        "/v1/lookup",
        json={"namespace": NS, "explain": True, "declined": True, **body},
        headers=headers,
    )
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_a_declined_lookup_counts_what_is_held_as_declined_and_moves_nothing(
    client: TestClient, clock: ManualClock
):
    open_session(client, "mla", ttl_s=600)
    toks = tokens(50, 6 * BT)
    hashes = store(client, toks, "mla")
    session = client.get("/v1/sessions/mla").json()
    before = touched(client, hashes)
    clock.advance(100)
    out = declined(client, {"tokens": toks + tokens(51, BT + 3), "session_id": "mla"})
    assert out["matched_blocks"] == 0 and out["matched_tokens"] == 0
    assert out["lease"] is None and out["blocks"] == []
    miss = out["miss"]
    assert miss["reason"] == "declined" and miss["block"] == 0 and miss["token"] == 0
    expected = {"diverged": 0, "evicted": 0, "expired": 0, "new": BT + 3, "declined": 6 * BT}
    assert miss["tokens"] == expected
    # no TTL, LRU, hit count or lease moved, nor the session's expiry
    assert touched(client, hashes) == before
    assert client.get("/v1/sessions/mla").json()["expires_at"] == session["expires_at"]
    attribution = client.get("/v1/sessions/mla").json()["attribution"]
    assert attribution["lookups"] == 1 and attribution["hit_tokens"] == 0
    assert attribution["miss_tokens"] == expected
    by_reason = metric(client, "sessioncache_miss_tokens_by_reason_total")
    assert by_reason['{reason="declined"}'] == 6 * BT
    missed = metric(client, "sessioncache_miss_tokens_total")[""]
    assert sum(by_reason.values()) == missed
    # by ids, as engines ask: the same
    ids = base64.b64encode(b"".join(bytes.fromhex(h) for h in hashes)).decode()
    by_id = declined(client, {"block_ids_b64": ids, "session_id": "mla"})
    assert by_id["matched_blocks"] == 0 and by_id["miss"]["tokens"]["declined"] == 6 * BT
    assert touched(client, hashes) == before
    # a plain lookup still hits the whole prompt
    assert lookup(client, toks, "mla")["matched_blocks"] == 6


def test_a_declined_lookup_takes_no_lease(client: TestClient):
    body = {"namespace": NS, "tokens": tokens(52, 2 * BT), "declined": True, "lease_ms": 1000}
    r = client.post("/v1/lookup", json=body)
    assert r.status_code == 422 and "no lease" in r.text, r.text
    body = {"namespace": NS, "tokens": tokens(52, 2 * BT), "declined": True, "session_id": "nope"}
    assert client.post("/v1/lookup", json=body).status_code == 404


def test_a_declined_lookup_of_another_tenants_prompt_reveals_and_counts_nothing(
    auth: TestClient,
):
    a = {"authorization": "Bearer key-a"}
    b = {"authorization": "Bearer key-b"}
    open_session(auth, "alice", ttl_s=600, headers=a)
    toks = tokens(53, 4 * BT)
    hashes = store(auth, toks, "alice", **a)
    before = touched(auth, hashes)
    # globex names acme's ids, then sends the same tokens: neither is its own
    ids = base64.b64encode(b"".join(bytes.fromhex(h) for h in hashes)).decode()
    for body in ({"block_ids_b64": ids}, {"tokens": toks}):
        out = declined(auth, body, **b)
        assert out["matched_blocks"] == 0
        assert out["miss"]["reason"] == "new" and out["miss"]["tokens"]["declined"] == 0
    # nor may it name acme's session
    assert declined_status(auth, {"tokens": toks, "session_id": "alice"}, **b) == 404
    assert touched(auth, hashes) == before
    mine = auth.get("/v1/sessions/alice", headers=a).json()["attribution"]
    assert mine["lookups"] == 0 and sum(mine["miss_tokens"].values()) == 0
    # acme's own declined lookup is acme's
    assert declined(auth, {"tokens": toks, "session_id": "alice"}, **a)["miss"]["reason"] == (
        "declined"
    )
    mine = auth.get("/v1/sessions/alice", headers=a).json()["attribution"]
    assert mine["lookups"] == 1 and mine["miss_tokens"]["declined"] == 4 * BT


def declined_status(client: TestClient, body: dict[str, Any], **headers: str) -> int:
    r = client.post("/v1/lookup", json={"namespace": NS, "declined": True, **body}, headers=headers)
    return r.status_code
