"""Sessions, token accounting and attribution on the data plane, against real node processes:
a session named in a stream or same-host request pins and extends its chain, sets its head and
counts its hit tokens with no REST call; loads without a session count too; a tenant cannot act
on another's session."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import numpy as np
import pytest

from sessioncache.connector import SessionCacheClient
from sessioncache.connector.transfer import KVTransfer
from sessioncache.errors import InvalidInput, SessionNotFound
from sessioncache.hashing import Namespace
from tests.support.servers import Server, start_server

BLOCK = 32 * 1024
BT = 16
KEYS = {"key-alice": "alice", "key-bob": "bob"}
PATHS = ["same_host", "stream"]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("dp-sessions") / "data")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("dp-sessions-auth") / "data",
        {
            "SESSIONCACHE_API_KEYS": json.dumps(KEYS),
            "SESSIONCACHE_SHM_TRUSTED_TENANTS": json.dumps(sorted(KEYS.values())),
        },
    )
    yield server
    server.stop()


def client_for(server: Server, model: str, key: str | None = None) -> SessionCacheClient:
    return SessionCacheClient(server.url, namespace=Namespace(model, BT, "bf16", "x"), api_key=key)


def prompt(seed: int, blocks: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, BT * blocks)]


def payloads(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(n)]


def hit_tokens(server: Server) -> int:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    found = re.search(r"^sessioncache_hit_tokens_total (\S+)$", text, re.M)
    assert found is not None, "no sessioncache_hit_tokens_total in /metrics"
    return int(float(found.group(1)))


def prefill_hit_tokens(server: Server) -> int:
    overview: dict[str, Any] = httpx.get(f"{server.url}/admin/api/overview", timeout=10).json()
    return int(overview["prefill"]["hit_tokens"])


@contextmanager
def no_rest(client: SessionCacheClient) -> Iterator[None]:
    """Any REST call of ``client`` fails the test (the data plane must not need one)."""

    def refuse(request: Any) -> Any:
        raise AssertionError(f"a REST call on the data plane: {request.method} {request.path}")

    saved = client._send_once
    client._send_once = refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        client._send_once = saved  # type: ignore[method-assign]


@pytest.mark.parametrize("path", PATHS)
def test_a_session_travels_with_the_bytes(node: Server, path: str):
    first, second = prompt(1, 6), prompt(1, 6) + prompt(2, 3)
    with client_for(node, f"m-{path}") as client, KVTransfer(client, path=path) as kv:  # type: ignore[arg-type]
        assert kv.path == path  # connected (GET /v1/dataplane) before the data-plane work
        session = client.open_session(kind="agent")
        hits, prefill = hit_tokens(node), prefill_hit_tokens(node)
        out = [np.zeros(BLOCK, dtype=np.uint8) for _ in range(9)]
        with no_rest(client):
            assert kv.load_into(first, out, session_id=session.id).blocks == 0  # turn 1: new
            assert kv.store_from(first, payloads(3, 6), session_id=session.id).blocks == 6
            assert kv.load_into(second, out, session_id=session.id).blocks == 6  # turn 2
            assert kv.store_from(second, payloads(4, 3), session_id=session.id, first_block=6)
        got = client.get_session(session.id)
        ids = client.block_hashes(second)
        assert got.head == ids[-1] and got.pinned
        assert got.attribution is not None
        assert got.attribution.lookups == 2 and got.attribution.hit_tokens == 6 * BT
        assert got.attribution.miss_tokens["new"] == 6 * BT + 3 * BT
        assert got.last_seen > session.last_seen and got.expires_at > session.expires_at
        assert hit_tokens(node) - hits == 6 * BT
        assert prefill_hit_tokens(node) - prefill == 6 * BT
        # the dashboard's session: its chain of 9 blocks, every one pinned, its hit tokens
        detail = httpx.get(
            f"{node.url}/admin/api/sessions/{session.tenant}/{session.id}", timeout=10
        ).json()
        assert detail["blocks"] == 9 and all(b["pinned"] for b in detail["chain"]), detail
        assert detail["hit_tokens"] == 6 * BT


@pytest.mark.parametrize("path", [*PATHS, "rest"])
def test_a_finish_reason_travels_with_the_store_or_alone(node: Server, path: str):
    """``store_from(..., finish_reason=...)`` on every path: with the blocks (no REST call on
    the data plane), or alone (``finish_session``) when there are none; the node's forecast it
    sets is read back in tests/sessioncache/dataplane/test_finish.py and tests/api."""
    tokens = prompt(11, 4)
    with client_for(node, f"m-finish-{path}") as client, KVTransfer(client, path=path) as kv:  # type: ignore[arg-type]
        assert kv.path == path  # connected before the data-plane work
        session = client.open_session(kind="agent")
        child = client.open_session(kind="agent", parent=session.id)
        assert child.id != session.id
        if path == "rest":
            assert (
                kv.store_from(
                    tokens, payloads(12, 4), session_id=session.id, finish_reason="tool_use"
                ).blocks
                == 4
            )
        else:
            with no_rest(client):
                done = kv.store_from(
                    tokens, payloads(12, 4), session_id=session.id, finish_reason="tool_use"
                )
                assert done.blocks == 4
        assert client.get_session(session.id).head == client.block_hashes(tokens)[-1]
        alone = kv.store_from(
            tokens, [], session_id=session.id, first_block=4, finish_reason="stop"
        )
        assert alone.blocks == 0
        assert client.finish_session(session.id, "end_turn").head == client.block_hashes(tokens)[-1]
        with pytest.raises(InvalidInput, match="session"):
            kv.store_from(tokens, payloads(12, 4), finish_reason="stop")
        with pytest.raises(InvalidInput, match="finish_reason"):
            client.finish_session(session.id, "done")


@pytest.mark.parametrize("path", PATHS)
def test_loads_without_a_session_count_too(node: Server, path: str):
    tokens = prompt(5, 4)
    with client_for(node, f"m-plain-{path}") as client, KVTransfer(client, path=path) as kv:  # type: ignore[arg-type]
        kv.store_from(tokens, payloads(6, 4))
        hits = hit_tokens(node)
        out = [np.zeros(BLOCK, dtype=np.uint8) for _ in range(4)]
        with no_rest(client):
            for _ in range(3):
                assert kv.load_into(tokens, out).blocks == 4
        assert hit_tokens(node) - hits == 3 * 4 * BT


def test_explain_on_the_stream_says_why(node: Server):
    tokens = prompt(7, 5)
    with client_for(node, "m-explain") as client, client.stream() as stream:
        root = stream.resolve(client.namespace)
        ids = stream.block_hashes(root, tokens)
        stream.store(root, tokens[: 3 * BT], payloads(8, 3))
        found = stream.lookup(root, ids, explain=True)
        assert found.matched == 3
        assert found.miss is not None
        assert found.miss.reason == "new" and found.miss.block == 3
        assert found.miss.token == 3 * BT
        assert found.miss.tokens["new"] == 2 * BT
        assert stream.lookup(root, ids).miss is None  # not asked: not sent


@pytest.mark.parametrize("path", PATHS)
def test_a_tenant_cannot_act_on_another_tenants_session(shared: Server, path: str):
    tokens = prompt(9, 4)
    with (
        client_for(shared, f"m-{path}", "key-alice") as alice,
        client_for(shared, f"m-{path}", "key-bob") as bob,
        KVTransfer(bob, path=path) as bob_kv,  # type: ignore[arg-type]
    ):
        session = alice.open_session(kind="agent")
        before = alice.get_session(session.id)
        out = [np.zeros(BLOCK, dtype=np.uint8) for _ in range(4)]
        with pytest.raises(SessionNotFound):
            bob_kv.store_from(tokens, payloads(10, 4), session_id=session.id)
        with pytest.raises(SessionNotFound):
            bob_kv.load_into(tokens, out, session_id=session.id)
        after = alice.get_session(session.id)
        assert after.head is None and not after.pinned
        assert after.last_seen == before.last_seen
        # bob's connection still serves bob
        assert bob_kv.store_from(tokens, payloads(10, 4)).blocks == 4
        assert bob_kv.load_into(tokens, out).blocks == 4
