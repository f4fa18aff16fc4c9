"""Agent hints on the data plane (SESSION ``hint``): the stream and the same-host socket take
the bodies ``POST /v1/sessions/{id}/hints`` takes and answer as REST does, a malformed hint is
``InvalidInput`` and leaves the connection working, and a tenant reaches only its own
sessions."""

from __future__ import annotations

import numpy as np
import pytest

from sessioncache.connector import StreamClient
from sessioncache.dataplane import frames
from sessioncache.errors import InvalidInput, SessionNotFound
from sessioncache.node import CacheNode
from tests.sessioncache.dataplane.test_session_ops import (
    BLOCK,
    NS,
    Connect,
    connect,
    node,
    samehost_server,
    stream_server,
)

__all__ = ["connect", "node", "samehost_server", "stream_server"]  # the fixtures


def stored(client: StreamClient, sid: str, seed: int, blocks: int) -> None:
    """``sid``'s request stores ``blocks`` blocks: its chain, pinned."""
    tokens = [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, 4 * blocks)]
    payloads = [np.full(BLOCK, i, dtype=np.uint8) for i in range(blocks)]
    root = client.resolve(NS)
    client.store(root, tokens, payloads, session_id=sid)


def test_a_hint_on_the_stream_answers_as_rest_does(connect: Connect, node: CacheNode):
    alice = connect("key-a")
    assert "hint" in frames.VERBS
    alice.open_session("dp-hint")
    stored(alice, "dp-hint", 1, 4)
    body = {"agent_hints": {"cache_ttl_ms": 120_000, "reuse_hint": "keep"}}
    out = alice.hint_session("dp-hint", body)
    assert out.id == "dp-hint" and out.pinned
    state = node.sessions.hints.snapshot(("alice", "dp-hint"))
    assert state is not None and (state.ttl_s, state.priority) == (120, 100)
    uni = {"agent_hint": {"schema_version": 1, "kv_priority": 30, "final": True}}
    out = alice.hint_session("dp-hint", uni)
    assert not out.pinned
    state = node.sessions.hints.snapshot(("alice", "dp-hint"))
    assert state is not None and state.final and state.priority == 30
    directives = {"retention_directives": [{"start": 0, "priority": 60, "duration": 30}]}
    assert alice.hint_session("dp-hint", directives, block_tokens=4).id == "dp-hint"
    with pytest.raises(InvalidInput, match="reuse_hint"):
        alice.hint_session("dp-hint", {"agent_hints": {"reuse_hint": "always"}})
    with pytest.raises(InvalidInput, match="no hint"):
        alice.hint_session("dp-hint", {})
    assert alice.get_session("dp-hint").id == "dp-hint"  # the connection carries on
    alice.close_session("dp-hint")


def test_a_tenant_cannot_hint_another_tenants_session(connect: Connect, node: CacheNode):
    alice, bob = connect("key-a"), connect("key-b")
    alice.open_session("theirs")
    stored(alice, "theirs", 2, 2)
    with pytest.raises(SessionNotFound):
        bob.hint_session("theirs", {"agent_hints": {"reuse_hint": "discard"}})
    assert alice.get_session("theirs").pinned
    assert node.sessions.hints.snapshot(("alice", "theirs")) is None
    alice.close_session("theirs")


def test_the_session_frame_round_trips_a_hint():
    call = frames.SessionCall("hint", "s", hint={"agent_hints": {"cache_ttl_ms": 5}})
    data = frames.encode_session_call(7, call)
    assert frames.decode_session_call(data[frames.HEADER_SIZE :]) == call
    with pytest.raises(InvalidInput, match="a hint is required"):
        frames.encode_session_call(7, frames.SessionCall("hint", "s"))
    bad = b'{"verb":"hint","session_id":"s","hint":[1]}'
    with pytest.raises(InvalidInput, match="hint must be an object"):
        frames.decode_session_call(bad)


def test_a_prefetch_on_the_stream(connect: Connect, node: CacheNode):
    alice, bob = connect("key-a"), connect("key-b")
    alice.open_session("dp-prefetch")
    stored(alice, "dp-prefetch", 3, 4)
    got = alice.prefetch_session("dp-prefetch")
    assert got.outcome == "accepted" and got.blocks == 0  # in the CPU tier already
    assert node.prefetch.resident(("alice", "dp-prefetch"))["cpu"] == 4
    with pytest.raises(SessionNotFound):
        bob.prefetch_session("dp-prefetch")
    alice.open_session("dp-empty")
    assert alice.prefetch_session("dp-empty").outcome == "rejected"
    hinted = alice.hint_session("dp-prefetch", {"agent_hints": {"prefetch": True}})
    assert hinted.id == "dp-prefetch"
    for sid in ("dp-prefetch", "dp-empty"):
        alice.close_session(sid)
