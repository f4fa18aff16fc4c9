"""Session ids are scoped by tenant: what bob does with an id never shows in, or changes,
alice's session of the same id, on REST and on the stream, and across a restart."""

from __future__ import annotations

import httpx

from sessioncache.connector import StreamClient
from sessioncache.hashing import Namespace
from tests.security.conftest import ALICE, BOB, NodeFactory, client

NS = {"model": "scope", "block_tokens": 4, "kv_dtype": "u8", "kv_layout": "x"}
PROMPT = list(range(16))


def store(c: httpx.Client, session_id: str, tokens: list[int], fill: int) -> list[str]:
    plan = c.post("/v1/store", json={"namespace": NS, "tokens": tokens, "session_id": session_id})
    assert plan.status_code == 200, plan.text
    for h in plan.json()["missing"]:
        assert c.put(f"/v1/blocks/{h}", content=bytes([fill]) * 64).status_code == 200
    return list(plan.json()["hashes"])


def test_one_session_id_is_two_independent_sessions(guarded_node: NodeFactory) -> None:
    node = guarded_node()
    with client(node, ALICE) as alice, client(node, BOB) as bob:
        first = alice.post("/v1/sessions", json={"session_id": "s1", "ttl_s": 600})
        assert first.status_code == 201, first.text
        # bob's create of the same id is no oracle of alice's: a fresh session of his own
        theirs = bob.post("/v1/sessions", json={"session_id": "s1", "kind": "chat"})
        assert theirs.status_code == 201, theirs.text
        assert theirs.json()["kind"] == "chat" and first.json()["kind"] == "agent"
        assert alice.get("/v1/sessions/s1").json()["kind"] == "agent"

        store(alice, "s1", PROMPT, 1)
        hit = alice.post(
            "/v1/lookup", json={"namespace": NS, "tokens": PROMPT, "session_id": "s1"}
        ).json()
        assert hit["matched_tokens"] == 16
        bob_look = bob.post(
            "/v1/lookup", json={"namespace": NS, "tokens": PROMPT, "session_id": "s1"}
        )
        assert bob_look.status_code == 200, bob_look.text  # his own session; his own namespace
        assert alice.get("/v1/sessions/s1").json()["attribution"]["hit_tokens"] == 16
        assert bob.get("/v1/sessions/s1").json()["attribution"]["hit_tokens"] == 0

        # bob closing his s1 leaves alice's open and pinned
        assert bob.delete("/v1/sessions/s1").status_code == 204
        assert bob.get("/v1/sessions/s1").status_code == 404
        mine = alice.get("/v1/sessions/s1")
        assert mine.status_code == 200 and mine.json()["pinned"], mine.text
        assert [s["id"] for s in alice.get("/v1/sessions").json()["sessions"]] == ["s1"]

        # the stream names sessions the same way
        with StreamClient.discover(node.url, api_key="key-bob", timeout=10) as s:
            root = s.resolve(Namespace("scope", 4, "u8", "stream"))
            assert bob.post("/v1/sessions", json={"session_id": "s1"}).status_code == 201
            assert s.lookup(root, [], session_id="s1").hashes == []
        assert alice.get("/v1/sessions/s1").json()["kind"] == "agent"

    node.stop()
    again = guarded_node(data_dir=node.server.data_dir)
    with client(again, ALICE) as alice, client(again, BOB) as bob:
        assert alice.get("/v1/sessions/s1").json()["kind"] == "agent"
        assert bob.get("/v1/sessions/s1").json()["kind"] == "agent"  # his second s1
        assert alice.delete("/v1/sessions/s1").status_code == 204
        assert bob.get("/v1/sessions/s1").status_code == 200
