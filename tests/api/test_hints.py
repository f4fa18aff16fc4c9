"""Agent hints through the REST API (``POST /v1/sessions/{id}/hints``), on a node in this
process whose pins and forecast the test reads back (``ManualClock``): each of the field's
formats is taken and shown by the session's GET, a malformed one is a 422 that says what is
wrong, a soft TTL holds the pins past the idle timeout and is capped, ``final`` and
``discard`` unpin now, a priority orders eviction, and another tenant's session is not found."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from sessioncache.api.app import create_app
from sessioncache.clock import ManualClock
from sessioncache.config import Settings
from sessioncache.errors import InvalidInput
from sessioncache.factory import open_node
from sessioncache.hashing import BlockHash
from sessioncache.node import CacheNode
from sessioncache.sessions.forecasts import scale
from sessioncache.sessions.hints import KEEP, NEUTRAL, Hint, Span, parse_hints
from sessioncache.store.forecast import ORPHAN_BASE, POOLED, Forecast
from tests.api.test_finish import ACME, BLOCK, NS, ahead, client, forecast, node, tokens
from tests.api.test_finish import GLOBEX as BOB

__all__ = ["client", "forecast", "node"]  # the fixtures, the acme tenant's node and client
NOW = 1_700_000_000.0
"""The node's ``ManualClock`` (it stays there but where a test moves it)."""


def held(client: TestClient, sid: str, toks: list[int], **extra: Any) -> list[str]:
    """Open ``sid`` and store ``toks``' blocks on its behalf (its chain, pinned)."""
    r = client.post("/v1/sessions", json={"session_id": sid})
    assert r.status_code == 201, r.text
    plan = client.post("/v1/store", json={"namespace": NS, "tokens": toks})
    for h in plan.json()["missing"]:
        assert client.put(f"/v1/blocks/{h}", content=bytes.fromhex(h) * (BLOCK // 16)).is_success
    plan = client.post(
        "/v1/store", json={"namespace": NS, "tokens": toks, "session_id": sid, **extra}
    )
    assert plan.status_code == 200, plan.text
    hashes: list[str] = plan.json()["hashes"]
    return hashes


def hint(client: TestClient, sid: str, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
    r = client.post(f"/v1/sessions/{sid}/hints", json=body, **kw)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def pins(node: CacheNode, block: str) -> int:
    meta = node.store.reads.meta(BlockHash(bytes.fromhex(block)))
    assert meta is not None
    return meta.pins


# -- the parsers ------------------------------------------------------------------------------


def test_each_format_parses_onto_one_mapping():
    uni = {"schema_version": 1, "trajectory_id": "t-1", "kv_priority": 80}
    uni |= {"lease_until": NOW + 30, "tools_available": ["search"]}
    h = parse_hints({"agent_hint": uni}, NOW)
    assert (h.priority, h.back_in_s, h.session_id) == (80, 30.0, "t-1")
    h = parse_hints({"agent_hint": {"schema_version": 1, "kv_priority": "discard"}}, NOW)
    assert h.discard and h.priority == 0
    rfc = {"session_id": "s", "parent_session_id": "p", "cache_control": {}}
    rfc["edits"] = [
        {"type": "evict", "block_start": 4, "block_end": 8},
        {"type": "offload", "block_start": 2, "block_end": 4},
        {"type": "prefetch", "block_start": 0, "block_end": 8},
    ]
    h = parse_hints({"agent_hint": rfc}, NOW)
    assert (h.ttl_s, h.parent, h.prefetch) == (300.0, "p", True)  # the default TTL
    assert h.evict == (Span(4, 8, 0),) and h.spans == (Span(2, 4, 0),)
    sg = {"cache_ttl_ms": 90_000, "reuse_hint": "keep", "expected_tool_duration_ms": 2500}
    sg |= {"workflow_id": "w", "agent_id": "a", "step_id": 3, "parent_step_id": 2}
    h = parse_hints({"agent_hints": sg}, NOW)
    assert (h.ttl_s, h.priority, h.back_in_s, h.session_id) == (90.0, KEEP, 2.5, "w")
    directives = [
        {"start": 0, "end": 64, "priority": 90, "duration": 600},
        {"start": 64, "end": None, "priority": 20, "duration": 60},
    ]
    h = parse_hints({"retention_directives": directives, "retention_scope": "session"}, NOW, 16)
    assert (h.ttl_s, h.priority) == (600.0, 20)
    assert h.spans == (Span(0, 4, 90), Span(4, None, 20))
    # the format's order is enforced, not refused: by start, overlaps cut, priorities lowered
    unordered = [
        {"start": 64, "end": None, "priority": 60},
        {"start": 0, "end": 80, "priority": 40},
        {"start": 16, "end": 32, "priority": 90},
    ]
    h = parse_hints({"retention_directives": unordered}, NOW, 16)
    assert h.priority == 40 and h.spans == (Span(0, 5, 40), Span(5, None, 40))
    empty = [{"start": 10, "end": 10, "priority": 50}]
    assert parse_hints({"retention_directives": empty}, NOW, 16) == Hint()
    backwards = {"type": "evict", "block_start": 5, "block_end": 2}
    assert parse_hints({"agent_hint": {"edits": [backwards]}}, NOW).evict == ()
    # several formats in one body (a forwarded kv_transfer_params): merged, others ignored
    both = {"session_id": "x", "agent_hint": uni, "agent_hints": {"cache_ttl_ms": 1000}}
    h = parse_hints(both, NOW)
    assert (h.priority, h.ttl_s) == (80, 1.0)
    assert parse_hints({"agent_hints": {"reuse_hint": "neutral"}}, NOW).priority == NEUTRAL


MALFORMED: list[tuple[dict[str, Any], str]] = [
    ({"session_id": "s"}, "no hint"),
    ({"agent_hint": {"schema_version": 2}}, "schema_version"),
    ({"agent_hint": {"schema_version": 1, "kv_priority": 101}}, "kv_priority"),
    ({"agent_hint": {"schema_version": 1, "kv_priority": "urgent"}}, "kv_priority"),
    ({"agent_hint": {"schema_version": 1, "lease_until": "soon"}}, "lease_until"),
    ({"agent_hint": {"cache_control": {"ttl": 7200}}}, "cache_control.ttl"),
    ({"agent_hint": {"cache_control": {"ttl": 0}}}, "cache_control.ttl"),
    ({"agent_hint": {"edits": [{"type": "shred"}]}}, "type"),
    ({"agent_hint": {"edits": [{"type": "evict", "block_start": -1}]}}, "block_start"),
    ({"agent_hint": {"parent_session_id": ""}}, "parent_session_id"),
    ({"agent_hints": {"reuse_hint": "forever"}}, "reuse_hint"),
    ({"agent_hints": {"cache_ttl_ms": -5}}, "cache_ttl_ms"),
    ({"agent_hints": {"expected_tool_duration_ms": True}}, "expected_tool_duration_ms"),
    ({"retention_directives": []}, "retention_directives"),
    ({"retention_directives": [{"start": 0, "priority": 50, "duration": -1}]}, "duration"),
    ({"retention_directives": [{"start": 0}]}, "priority"),
    ({"retention_directives": [{"priority": 5}]}, "start"),
    ({"agent_hint": {"edits": [{"block_start": 1}]}}, "type"),
]


@pytest.mark.parametrize(("body", "says"), MALFORMED)
def test_a_malformed_hint_is_a_422_that_says_what(
    client: TestClient, body: dict[str, Any], says: str
):
    held(client, "s", tokens(1, 32))
    r = client.post("/v1/sessions/s/hints", json=body)
    assert r.status_code == 422, r.text
    if says != "x":
        assert says in json.dumps(r.json()), r.text
    with pytest.raises(InvalidInput):
        parse_hints(body, NOW)
    # nothing was taken
    assert client.get("/v1/sessions/s").json()["hint"] is None


# -- what the node does -----------------------------------------------------------------------


def test_the_sessions_get_shows_the_hints_ttl_priority_and_return(
    client: TestClient, node: CacheNode
):
    held(client, "s", tokens(2, 64))
    sg = {"agent_hints": {"cache_ttl_ms": 600_000, "reuse_hint": "keep"}}
    out = hint(client, "s", sg)
    assert out["hint"]["ttl_s"] == 600 and out["hint"]["priority"] == KEEP
    uni = {"agent_hint": {"schema_version": 1, "kv_priority": 70, "lease_until": NOW + 45}}
    hint(client, "s", uni)
    got = client.get("/v1/sessions/s").json()
    assert got["hint"] == {"ttl_s": 600, "priority": 70, "final": False, "back_at": NOW + 45}
    assert got["expected_back"] == NOW + 45  # the lease feeds the forecast
    assert got["pinned"]


def test_an_expected_return_and_a_priority_order_eviction(
    client: TestClient, node: CacheNode, forecast: Forecast
):
    a = held(client, "a", tokens(3, 64), finish_reason="end_turn")
    b = held(client, "b", tokens(4, 64), finish_reason="end_turn")
    assert ahead(node, a[-1]) == pytest.approx(forecast.gaps["stop"])
    hint(client, "a", {"agent_hints": {"expected_tool_duration_ms": 20_000}})
    assert ahead(node, a[-1]) == pytest.approx(20.0)  # back in 20 s: its next use
    hint(client, "b", {"agent_hints": {"reuse_hint": "keep"}})
    assert ahead(node, b[-1]) == pytest.approx(forecast.gaps["stop"] / 16)
    # a later finish keeps the hint's rank
    client.post("/v1/sessions/b/finish", json={"finish_reason": "end_turn"})
    assert ahead(node, b[-1]) == pytest.approx(forecast.gaps["stop"] / 16)
    c = held(client, "c", tokens(5, 64), finish_reason="tool_use")
    hint(client, "c", {"agent_hint": {"schema_version": 1, "kv_priority": "low"}})
    assert ahead(node, c[-1]) == pytest.approx(forecast.gaps["tool"] * 4)
    # the expected return lapses once passed: the forecast takes over again
    node.store.clock.advance(30)  # type: ignore[attr-defined]
    client.post("/v1/sessions/a/finish", json={"finish_reason": "end_turn"})
    assert ahead(node, a[-1]) == pytest.approx(forecast.gaps["stop"])


def test_an_expected_return_is_spent_when_the_session_comes_back(
    client: TestClient, node: CacheNode, forecast: Forecast
):
    toks = tokens(6, 64)
    a = held(client, "a", toks, finish_reason="end_turn")
    hint(client, "a", {"agent_hints": {"expected_tool_duration_ms": 3_600_000}})
    assert ahead(node, a[-1]) == pytest.approx(3600.0)
    # Back after 10 s, not an hour: the request uses the chain now, so it is filed as a
    # running request's (the forecast's), not at the hour the hint expected.
    node.store.clock.advance(10)  # type: ignore[attr-defined]
    r = client.post("/v1/lookup", json={"namespace": NS, "tokens": toks, "session_id": "a"})
    assert r.status_code == 200, r.text
    assert ahead(node, a[-1]) == pytest.approx(forecast.in_flight_s)
    assert client.get("/v1/sessions/a").json()["hint"]["back_at"] is None


def test_retention_directives_rank_parts_of_the_chain(
    client: TestClient, node: CacheNode, forecast: Forecast
):
    chain = held(client, "r", tokens(6, 128), finish_reason="end_turn")  # 8 blocks
    directives = [
        {"start": 0, "end": 64, "priority": 100, "duration": 120},
        {"start": 64, "end": None, "priority": 50},
    ]
    out = hint(client, "r", {"retention_directives": directives, "block_tokens": 16})
    assert out["hint"]["ttl_s"] == 120 and out["hint"]["priority"] == 50
    stop = forecast.gaps["stop"]
    assert [ahead(node, h) for h in chain[:4]] == pytest.approx([stop / 16] * 4)
    assert [ahead(node, h) for h in chain[4:]] == pytest.approx([stop] * 4)


def test_a_soft_ttl_holds_the_pins_and_is_capped(client: TestClient, node: CacheNode):
    chain = held(client, "t", tokens(7, 64))
    out = hint(client, "t", {"agent_hint": {"cache_control": {"ttl": 3600}}})
    assert out["hint"]["ttl_s"] == 3600
    clock = node.store.clock
    clock.advance(1800)  # type: ignore[attr-defined]  # past the 300 s idle timeout
    node.sessions.sweep()
    assert client.get("/v1/sessions/t").json()["pinned"] and pins(node, chain[0]) == 1
    clock.advance(1801)  # type: ignore[attr-defined]
    node.sessions.sweep()
    assert not client.get("/v1/sessions/t").json()["pinned"] and pins(node, chain[0]) == 0
    # SGLang's TTL has no bound of its own: the node's (3600 s) and the session's cap it
    capped = hint(client, "t", {"agent_hints": {"cache_ttl_ms": 86_400_000}})
    assert capped["hint"]["ttl_s"] == 3600
    client.post("/v1/sessions", json={"session_id": "short", "ttl_s": 60})
    short = hint(client, "short", {"agent_hints": {"cache_ttl_ms": 600_000}})
    assert short["hint"]["ttl_s"] == 60


def test_final_and_discard_unpin_now(client: TestClient, node: CacheNode, forecast: Forecast):
    chain = held(client, "f", tokens(8, 64))
    assert pins(node, chain[-1]) == 1
    # Dynamo's final, as a priority-less agent_hint field is not: discard (SGLang) unpins
    out = hint(client, "f", {"agent_hints": {"reuse_hint": "discard"}})
    assert not out["pinned"] and pins(node, chain[-1]) == 0 and out["hint"]["priority"] == 0
    held(client, "f", tokens(8, 64))  # its next request pins again
    assert pins(node, chain[-1]) == 1
    r = client.post("/v1/sessions/f/hints", json={"agent_hint": {"final": True}})
    assert r.status_code == 200 and r.json()["hint"]["final"] is True
    assert pins(node, chain[-1]) == 0 and ahead(node, chain[-1]) > ORPHAN_BASE / 2  # leaves first
    held(client, "f", tokens(8, 64))  # a final session's requests pin nothing
    assert pins(node, chain[-1]) == 0 and not client.get("/v1/sessions/f").json()["pinned"]
    hint(client, "f", {"agent_hint": {"final": False}})
    held(client, "f", tokens(8, 64))
    assert pins(node, chain[-1]) == 1


def test_an_evict_edit_unpins_and_sends_its_blocks_first(client: TestClient, node: CacheNode):
    chain = held(client, "e", tokens(9, 128))  # 8 blocks
    edit = {"type": "evict", "block_start": 6, "block_end": 8}
    out = hint(client, "e", {"agent_hint": {"edits": [edit]}})
    assert not out["pinned"] and pins(node, chain[0]) == 0
    assert all(ahead(node, h) > ORPHAN_BASE / 2 for h in chain[6:])
    assert all(ahead(node, h) < ORPHAN_BASE / 2 for h in chain[:6])


def test_a_parent_hint_makes_a_subagent(client: TestClient, node: CacheNode):
    shared = tokens(10, 32)
    held(client, "parent", shared)
    child = held(client, "child", shared + tokens(11, 32))
    hint(client, "child", {"agent_hint": {"parent_session_id": "parent"}})
    assert node.sessions.forecasts.parent(("acme", "child")) == ("acme", "parent")
    assert client.delete("/v1/sessions/child").status_code == 204
    assert all(ahead(node, h) > ORPHAN_BASE / 2 for h in child[2:])
    assert all(ahead(node, h) < ORPHAN_BASE / 2 for h in child[:2])  # the parent's prefix


def test_another_tenant_cannot_hint_or_see_a_session(client: TestClient, node: CacheNode):
    chain = held(client, "mine", tokens(12, 64))
    body = {"agent_hints": {"reuse_hint": "discard"}}
    r = client.post("/v1/sessions/mine/hints", json=body, headers=BOB)
    assert r.status_code == 404, r.text
    assert client.get("/v1/sessions/mine", headers=BOB).status_code == 404
    got = client.get("/v1/sessions/mine").json()
    assert got["pinned"] and got["hint"] is None and pins(node, chain[0]) == 1
    assert client.post("/v1/sessions/nobody/hints", json=body).status_code == 404


# -- prefetch ---------------------------------------------------------------------------------


def test_prefetch_answers_202_and_the_get_shows_where_the_chain_is(
    client: TestClient, node: CacheNode
):
    chain = held(client, "p", tokens(13, 64))
    r = client.post("/v1/sessions/p/prefetch")
    assert r.status_code == 202, r.text
    assert r.json() == {"outcome": "accepted", "reason": r.json()["reason"], "blocks": 0}
    assert client.get("/v1/sessions/p").json()["resident"]["cpu"] == len(chain)
    # SGLang's prefetch and vLLM's prefetch edit ask for the same
    out = hint(client, "p", {"agent_hints": {"prefetch": True}})
    assert out["prefetch"]["outcome"] == "accepted"
    edit = {"type": "prefetch", "block_start": 0, "block_end": 4}
    assert hint(client, "p", {"agent_hint": {"edits": [edit]}})["prefetch"] is not None
    assert hint(client, "p", {"agent_hints": {"reuse_hint": "keep"}})["prefetch"] is None
    client.post("/v1/sessions", json={"session_id": "empty"})
    empty = client.post("/v1/sessions/empty/prefetch")
    assert empty.status_code == 202 and empty.json()["outcome"] == "rejected"
    # another tenant's session is not found, whatever the call
    assert client.post("/v1/sessions/p/prefetch", headers=BOB).status_code == 404
    assert client.post("/v1/sessions/nobody/prefetch").status_code == 404


def test_a_prefetch_brings_a_chain_back_from_disk(tmp_path: Path):
    settings = Settings(
        data_dir=tmp_path / "data",
        cpu_bytes=8 * BLOCK,
        disk_bytes=64 * BLOCK,
        api_keys={"key-acme": "acme"},
    )
    node = open_node(settings, clock=ManualClock(), start=False)
    try:
        with TestClient(create_app(node), base_url="http://127.0.0.1", headers=ACME) as client:
            chain = held(client, "back", tokens(14, 64))  # 4 blocks
            hint(client, "back", {"agent_hint": {"final": True}})  # unpinned, leaves first
            for seed in (15, 16):  # 16 blocks of other work: its chain goes down to disk
                plan = client.post("/v1/store", json={"namespace": NS, "tokens": tokens(seed, 128)})
                for h in plan.json()["missing"]:
                    client.put(f"/v1/blocks/{h}", content=bytes.fromhex(h) * (BLOCK // 16))
            # the other work's disk copies written first: a CPU block still queued for the
            # disk cannot make room, and a move meeting one stops short
            behind = node.store._core.behind
            assert behind is None or behind.flush(10)
            before = client.get("/v1/sessions/back").json()["resident"]
            assert before.get("cpu", 0) < len(chain) and sum(before.values()) == len(chain)
            r = client.post("/v1/sessions/back/prefetch")
            assert r.status_code == 202 and r.json()["outcome"] == "accepted", r.text
            assert r.json()["blocks"] == len(chain) - before.get("cpu", 0)
            assert node.prefetch.drain() == 1  # the worker's move, here
            assert client.get("/v1/sessions/back").json()["resident"]["cpu"] == len(chain)
    finally:
        node.close()


def test_a_dead_chain_stays_dead_under_any_priority(forecast: Forecast):
    dead = ORPHAN_BASE - NOW
    value = Forecast(mode="value")
    assert scale(value, dead, NOW, KEEP) == dead and scale(value, dead, NOW, 0) == dead
    assert scale(forecast, dead, NOW, 0) == dead
    assert scale(forecast, dead, NOW, KEEP) == pytest.approx(
        NOW + forecast.ahead(forecast.priors[POOLED]) / 16
    )


def test_only_a_pinned_session_is_unpinned_by_a_hint(client: TestClient, node: CacheNode):
    held(client, "u", tokens(17, 32))
    causes: list[str] = []
    node.sessions.on_unpin(lambda key, cause: causes.append(cause) if key[1] == "u" else None)
    hint(client, "u", {"agent_hint": {"final": True}})
    hint(client, "u", {"agent_hints": {"reuse_hint": "discard"}})  # unpinned already
    assert causes == ["hint"]
