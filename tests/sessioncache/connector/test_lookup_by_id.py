"""``resolve`` and ``lookup_by_id`` of both clients against a real server, and the protocol
functions behind them."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from sessioncache.connector import (
    AsyncSessionCacheClient,
    IdMismatch,
    LookupResult,
    ProtocolError,
    SessionCacheClient,
    SessionNotFound,
    protocol,
)
from sessioncache.connector.protocol import Reply, Resolved
from sessioncache.hashing import BlockHash, NamespaceRoot, block_hashes
from tests.support.servers import Server

from .conftest import NS


def toks(seed: int, n: int = 44) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, n)]


def payload(i: int) -> bytes:
    return bytes([i % 256]) * 40 + i.to_bytes(4, "little")


def same(a: LookupResult, b: LookupResult) -> None:
    assert a.hashes == b.hashes and a.tiers == b.tiers
    assert a.prompt_hashes == b.prompt_hashes and a.block_tokens == b.block_tokens
    assert a.matched_blocks == b.matched_blocks and a.matched_tokens == b.matched_tokens


def test_resolve_is_the_servers_root_and_asked_once(open_server: Server) -> None:
    ns = replace(NS, model="by-id-resolve")
    with SessionCacheClient(open_server.url, namespace=ns) as c:
        paths: list[str] = []
        c._http.event_hooks["request"].append(lambda r: paths.append(r.url.path))
        resolved = c.resolve()
        assert resolved == Resolved(ns, ns.root(), 8, 0)
        assert c.resolve() is resolved and c.resolve(ns) is resolved
        other = replace(ns, salt="x")
        assert c.resolve(other).root == other.root() != resolved.root
        for seed in (1, 2):
            c.lookup_by_id(toks(seed))
        assert paths == ["/v1/namespaces/resolve"] * 2 + ["/v1/lookup"] * 2


def test_lookup_by_id_gives_what_lookup_gives(open_server: Server) -> None:
    ns = replace(NS, model="by-id-same")
    tokens = toks(3)  # 5 full blocks of 8 and a tail of 4
    with SessionCacheClient(open_server.url, namespace=ns) as c:
        empty = c.lookup_by_id(tokens)
        assert empty.matched_blocks == 0 and empty.hashes == [] and empty.tiers == []
        assert empty.prompt_hashes == block_hashes(ns, tokens)
        same(empty, c.lookup(tokens))
        c.store(tokens[:24], payload)  # 3 of the 5 blocks
        for prompt in (tokens, np.asarray(tokens, dtype=np.uint32), tokens[:24], tokens[:7]):
            by_id, by_tokens = c.lookup_by_id(prompt), c.lookup(prompt)
            same(by_id, by_tokens)
        found = c.lookup_by_id(tokens)
        assert found.matched_blocks == 3 and found.tiers == ["cpu"] * 3
        assert c.load(found.hashes) == [payload(i) for i in range(3)]


def test_lookup_by_id_with_a_session_and_a_lease(open_server: Server) -> None:
    ns = replace(NS, model="by-id-session")
    tokens = toks(4)
    with SessionCacheClient(open_server.url, namespace=ns) as c:
        s = c.open_session()
        stored = c.store(tokens, payload)
        found = c.lookup_by_id(tokens + [1] * 8, session_id=s.id, lease_ms=5_000)
        assert found.matched_blocks == 5 and found.lease is not None
        assert c.get_session(s.id).head == stored.hashes[-1]
        c.release(found.lease.id)
        with pytest.raises(SessionNotFound):
            c.lookup_by_id(tokens, session_id="no-such-session")


def test_auth_resolves_the_tenants_root(auth_server: Server) -> None:
    tokens = toks(5)
    with SessionCacheClient(auth_server.url, namespace=NS, api_key="k") as c:
        assert c.resolve().root == replace(NS, salt="t").root()
        stored = c.store(tokens, payload)
        found = c.lookup_by_id(tokens)
        assert found.hashes == stored.hashes and found.matched_blocks == 5
        same(found, c.lookup(tokens))


def test_a_seed_mismatch_is_caught_at_resolve(open_server: Server) -> None:
    with (
        SessionCacheClient(open_server.url, namespace=NS, seed=7) as c,
        pytest.raises(IdMismatch, match="seed 0, this client with seed 7"),
    ):
        c.lookup_by_id(toks(6))


def test_the_async_client_gives_the_same_results(open_server: Server) -> None:
    ns = replace(NS, model="by-id-async")
    tokens = toks(8)
    with SessionCacheClient(open_server.url, namespace=ns) as c:
        c.store(tokens[:32], payload)
        want = c.lookup_by_id(tokens)
        want_resolved = c.resolve()

    async def main() -> tuple[Resolved, LookupResult, LookupResult]:
        async with AsyncSessionCacheClient(open_server.url, namespace=ns) as a:
            resolved = await a.resolve()
            assert await a.resolve() is resolved
            return resolved, await a.lookup_by_id(tokens), await a.lookup(tokens)

    resolved, by_id, by_tokens = asyncio.run(main())
    assert resolved == want_resolved
    same(by_id, want)
    same(by_id, by_tokens)
    assert by_id.matched_blocks == 4


# -- the protocol functions ------------------------------------------------------------------


def reply(body: Any, status: int = 200) -> Reply:
    return Reply(status, {}, json.dumps(body).encode())


RESOLVED = Resolved(NS, NamespaceRoot(NS.root()), NS.block_tokens, 0)


def test_id_prompt_is_the_servers_chain() -> None:
    tokens = toks(9)
    p = protocol.id_prompt(RESOLVED, tokens)
    assert p.hashes == block_hashes(NS, tokens) and len(p.hashes) == 5
    assert json.loads(json.dumps(p.block_ids_b64)) == p.block_ids_b64
    request = protocol.lookup_ids_request(NS, p, session_id="s", lease_ms=10)
    assert request.json is not None
    assert request.json["block_ids_b64"] == p.block_ids_b64 and request.json["compact"] is True
    assert (request.json["session_id"], request.json["lease_ms"]) == ("s", 10)
    assert "tokens" not in request.json and "tokens_b64" not in request.json


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"root": "zz", "block_tokens": 8, "hash_seed": 0}, ProtocolError),
        ({"block_tokens": 8, "hash_seed": 0}, ProtocolError),
        ({"root": "ab" * 16, "block_tokens": 16, "hash_seed": 0}, ProtocolError),
        ({"root": "ab" * 16, "block_tokens": 8, "hash_seed": "0"}, ProtocolError),
        ({"root": "ab" * 16, "block_tokens": 8, "hash_seed": 3}, IdMismatch),
    ],
)
def test_parse_resolve_refuses_what_it_cannot_use(body: dict[str, Any], error: type) -> None:
    with pytest.raises(error):
        protocol.parse_resolve(reply(body), NS, 0)


def compact(matched: int, tiers: Any, **extra: Any) -> dict[str, Any]:
    return {
        "block_tokens": 8,
        "matched_blocks": matched,
        "matched_tokens": matched * 8,
        "tiers": tiers,
        "lease": None,
        **extra,
    }


def test_parse_compact_lookup() -> None:
    p = protocol.id_prompt(RESOLVED, toks(10))
    runs = [{"tier": "gpu", "blocks": 1}, {"tier": "cpu", "blocks": 2}]
    got = protocol.parse_compact_lookup(
        reply(compact(3, runs, lease={"id": "l", "expires_at": 5})), p
    )
    assert got.hashes == p.hashes[:3] and got.tiers == ["gpu", "cpu", "cpu"]
    assert got.lease is not None and (got.lease.id, got.lease.expires_at) == ("l", 5.0)
    assert got.prompt_hashes == p.hashes and got.matched_tokens == 24


@pytest.mark.parametrize(
    "body",
    [
        compact(6, [{"tier": "cpu", "blocks": 6}]),  # more than the 5 ids sent
        compact(-1, []),
        compact(2, [{"tier": "cpu", "blocks": 1}]),
        compact(1, [{"tier": "cpu", "blocks": 2}]),
        compact(1, [{"tier": "cpu", "blocks": 10**12}]),
        compact(1, [{"tier": "cpu", "blocks": 0}, {"tier": "cpu", "blocks": 1}]),
        compact(1, [["cpu", 1]]),
        compact(1, None),
        {**compact(1, [{"tier": "cpu", "blocks": 1}]), "block_tokens": 16},
        compact(1, [{"tier": "cpu", "blocks": 1}], lease="l"),
    ],
)
def test_parse_compact_lookup_refuses_what_does_not_add_up(body: dict[str, Any]) -> None:
    p = protocol.id_prompt(RESOLVED, toks(10))
    with pytest.raises(ProtocolError):
        protocol.parse_compact_lookup(reply(body), p)


SESSION = {
    "id": "s",
    "tenant": "t",
    "kind": "agent",
    "ttl_s": 60,
    "created": 1,
    "last_seen": 2,
    "expires_at": 62,
    "head": None,
    "pinned": False,
}


@pytest.mark.parametrize(
    ("attribution", "message"),
    [
        ([1], "attribution: expected an object"),
        ({"last_divergence": 3}, "attribution: last_divergence: expected an object"),
    ],
)
def test_parse_session_names_the_member_that_is_not_an_object(
    attribution: Any, message: str
) -> None:
    assert protocol.parse_session(reply({**SESSION, "attribution": None})).attribution is None
    with pytest.raises(ProtocolError, match=message):
        protocol.parse_session(reply({**SESSION, "attribution": attribution}))


@pytest.mark.parametrize(("member", "value"), [("lease", "l"), ("miss", [])])
def test_parse_compact_lookup_names_the_member_that_is_not_an_object(
    member: str, value: Any
) -> None:
    body = {**compact(1, [{"tier": "cpu", "blocks": 1}]), member: value}
    with pytest.raises(ProtocolError, match=f"^{member}: expected an object$"):
        protocol.parse_compact_lookup(reply(body), protocol.id_prompt(RESOLVED, toks(10)))


def test_matched_ids_are_the_clients_own() -> None:
    p = protocol.id_prompt(RESOLVED, toks(11))
    got = protocol.parse_compact_lookup(reply(compact(2, [{"tier": "cpu", "blocks": 2}])), p)
    assert all(isinstance(h, bytes) and len(h) == 16 for h in got.hashes)
    assert got.hashes == [BlockHash(h) for h in p.hashes[:2]]
