"""Finish reasons and parent sessions through the REST API, on a node in this process whose
forecast the test reads back (``ManualClock``): a store's ``finish_reason`` and
``POST /v1/sessions/{id}/finish`` set when the session is expected back, a subagent's
``parent`` spares their shared prefix at its close, and bad values are 422s that say why."""

from __future__ import annotations

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
from sessioncache.hashing import BlockHash
from sessioncache.node import CacheNode
from sessioncache.store.forecast import ORPHAN_BASE, Forecast

NS = {"model": "finish-model", "block_tokens": 16, "kv_dtype": "float16", "kv_layout": "test"}
BLOCK = 4096
KEYS = {"key-acme": "acme", "key-globex": "globex"}
ACME = {"Authorization": "Bearer key-acme"}
GLOBEX = {"Authorization": "Bearer key-globex"}


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 100_000, n)]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[CacheNode]:
    settings = Settings(  # keys as dates: the ``next_use`` order (the default's: test_chance.py)
        data_dir=tmp_path / "data",
        cpu_bytes=64 * BLOCK,
        disk_bytes=0,
        api_keys=KEYS,
        eviction_policy="next_use",
    )
    node = open_node(settings, clock=ManualClock(), start=False)
    yield node
    node.close()


@pytest.fixture
def client(node: CacheNode) -> Iterator[TestClient]:
    with TestClient(create_app(node), base_url="http://127.0.0.1", headers=ACME) as client:
        yield client


@pytest.fixture
def forecast(node: CacheNode) -> Forecast:
    assert node.store.forecast is not None  # the default policy forecasts
    return node.store.forecast


def open_session(client: TestClient, sid: str, **extra: Any) -> dict[str, Any]:
    r = client.post("/v1/sessions", json={"session_id": sid, **extra})
    assert r.status_code == 201, r.text
    out: dict[str, Any] = r.json()
    return out


def store(client: TestClient, toks: list[int], **extra: Any) -> list[str]:
    """``POST /v1/store`` and the uploads. The session's chain is recorded (and forecast) at
    the plan, for the blocks held then: a session's store here comes after the blocks are
    (``held``), as an engine's store of a finished turn's KV whose blocks it uploaded."""
    plan = client.post("/v1/store", json={"namespace": NS, "tokens": toks, **extra})
    assert plan.status_code == 200, plan.text
    for h in plan.json()["missing"]:
        r = client.put(f"/v1/blocks/{h}", content=bytes.fromhex(h) * (BLOCK // 16))
        assert r.status_code == 200, r.text
    hashes: list[str] = plan.json()["hashes"]
    return hashes


def held(client: TestClient, toks: list[int], **extra: Any) -> list[str]:
    """Store ``toks``' blocks, then the session's store of them (``store``)."""
    store(client, toks)
    return store(client, toks, **extra)


def ahead(node: CacheNode, block: str) -> float:
    """Seconds from now to the block's predicted next use."""
    meta = node.store.reads.meta(BlockHash(bytes.fromhex(block)))
    assert meta is not None
    return meta.next_use - node.store.clock.now()


def test_a_stores_finish_reason_sets_when_the_session_is_back(
    client: TestClient, node: CacheNode, forecast: Forecast
):
    for sid in ("running", "tool", "done"):
        open_session(client, sid)
    running = held(client, tokens(1, 64), session_id="running")
    tool = held(client, tokens(2, 64), session_id="tool", finish_reason="tool_use")
    done = held(client, tokens(3, 64), session_id="done", finish_reason="end_turn")
    assert ahead(node, running[-1]) == pytest.approx(forecast.in_flight_s)
    assert ahead(node, tool[-1]) == pytest.approx(forecast.gaps["tool"])
    assert ahead(node, done[-1]) == pytest.approx(forecast.gaps["stop"])


def test_the_finish_route_and_another_tenants_404(
    client: TestClient, node: CacheNode, forecast: Forecast
):
    open_session(client, "agent")
    hashes = held(client, tokens(4, 64), session_id="agent")
    assert ahead(node, hashes[-1]) == pytest.approx(forecast.in_flight_s)
    r = client.post("/v1/sessions/agent/finish", json={"finish_reason": "tool_calls"})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "agent" and r.json()["head"] == hashes[-1]
    assert ahead(node, hashes[-1]) == pytest.approx(forecast.gaps["tool"])
    other = client.post("/v1/sessions/agent/finish", json={"finish_reason": "stop"}, headers=GLOBEX)
    assert other.status_code == 404, other.text  # another tenant's session: not found
    assert ahead(node, hashes[-1]) == pytest.approx(forecast.gaps["tool"])  # untouched
    missing = client.post("/v1/sessions/nobody/finish", json={"finish_reason": "stop"})
    assert missing.status_code == 404


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("/v1/sessions/agent/finish", {"finish_reason": "done"}, "finish_reason"),
        ("/v1/sessions/agent/finish", {}, "finish_reason"),
        ("/v1/store", {"session_id": "agent", "finish_reason": "Stop"}, "finish_reason"),
        ("/v1/store", {"finish_reason": "stop"}, "session_id"),
        ("/v1/sessions", {"session_id": "child", "parent": "a/b"}, "parent"),
    ],
)
def test_bad_finish_reasons_and_parents_are_422s_that_say_why(
    client: TestClient, path: str, body: dict[str, Any], says: str
):
    open_session(client, "agent")
    if path == "/v1/store":
        body = {"namespace": NS, "tokens": tokens(5, 32), **body}
    r = client.post(path, json=body)
    assert r.status_code == 422, r.text
    assert says in json.dumps(r.json()), r.text


def test_a_subagents_close_spares_the_prefix_it_shares_with_its_parent(
    client: TestClient, node: CacheNode
):
    shared, own = tokens(6, 32), tokens(7, 32)
    open_session(client, "parent")
    held(client, shared, session_id="parent")
    child = open_session(client, "child", parent="parent")
    assert child["id"] == "child"
    hashes = held(client, shared + own, session_id="child")
    assert client.delete("/v1/sessions/child").status_code == 204
    # the child's own blocks have no forecast any more; the parent's prefix keeps its own
    assert all(ahead(node, h) > ORPHAN_BASE / 2 for h in hashes[2:])
    assert all(ahead(node, h) < ORPHAN_BASE / 2 for h in hashes[:2])
    # a close with no parent named takes the forecast off its chain up to the last fork (the
    # shared prefix is another branch's too)
    open_session(client, "orphan")
    again = held(client, shared + tokens(8, 32), session_id="orphan")
    assert client.delete("/v1/sessions/orphan").status_code == 204
    assert all(ahead(node, h) > ORPHAN_BASE / 2 for h in again[2:])
    assert all(ahead(node, h) < ORPHAN_BASE / 2 for h in again[:2])


def test_blocks_uploaded_after_a_sessions_store_are_filed_under_its_forecast(
    client: TestClient, node: CacheNode, forecast: Forecast
):
    open_session(client, "up")
    # the plan records the chain before the blocks arrive: each upload is filed as it lands
    hashes = store(client, tokens(9, 64), session_id="up", finish_reason="end_turn")
    assert all(ahead(node, h) == pytest.approx(forecast.gaps["stop"]) for h in hashes)
    got = client.get("/v1/sessions/up").json()
    assert got["last_finish"] == "stop"
    assert got["expected_back"] == pytest.approx(node.store.clock.now() + forecast.gaps["stop"])
    assert client.get("/v1/sessions/up", headers=GLOBEX).status_code == 404


def test_a_finished_turn_releases_its_pins_and_a_tool_call_keeps_them(tmp_path: Path):
    """With ``SESSIONCACHE_PINS_FOLLOW_FORECAST``, a turn that ended (its user back in over an
    hour at the forecast's quantile) holds no pins for the idle timeout; a tool call's session
    (back in seconds) stays pinned, and another tenant's finish of it is a 404 that leaves it
    so."""
    settings = Settings(
        data_dir=tmp_path / "data",
        cpu_bytes=64 * BLOCK,
        disk_bytes=0,
        api_keys=KEYS,
        pins_follow_forecast=True,
        eviction_policy="next_use",
    )
    node = open_node(settings, clock=ManualClock(), start=False)
    try:
        with TestClient(create_app(node), base_url="http://127.0.0.1", headers=ACME) as client:
            finished_turn_pins(client)
    finally:
        node.close()


def finished_turn_pins(client: TestClient) -> None:
    for sid in ("reader", "looper"):
        open_session(client, sid)
        held(client, tokens(len(sid), 64), session_id=sid)
    looper = client.post("/v1/sessions/looper/finish", json={"finish_reason": "tool_use"})
    reader = client.post("/v1/sessions/reader/finish", json={"finish_reason": "end_turn"})
    assert looper.status_code == reader.status_code == 200, (looper.text, reader.text)
    assert looper.json()["pinned"] is True and reader.json()["pinned"] is False
    other = client.post(
        "/v1/sessions/looper/finish", json={"finish_reason": "stop"}, headers=GLOBEX
    )
    assert other.status_code == 404, other.text
    assert client.get("/v1/sessions/looper").json()["pinned"] is True
