"""The sync and async clients against a real server: round trips, id checks, errors, auth."""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from sessioncache.connector import (
    AsyncSessionCacheClient,
    AuthError,
    Backoff,
    IdMismatch,
    InvalidRequest,
    LeaseNotFound,
    Retry,
    SessionCacheClient,
    SessionNotFound,
    UploadRefused,
)
from sessioncache.connector.protocol import Request
from sessioncache.errors import BlockNotFound as CoreBlockNotFound
from sessioncache.errors import InvalidInput, SessionCacheError
from sessioncache.hashing import block_hashes
from tests.support.servers import Server

from .conftest import NS


class Recording(Backoff):
    """Records every ``compute`` call (one per retry) and never sleeps."""

    def __init__(self, delay: float = 0.0) -> None:
        self.failures: list[int] = []
        self.delay = delay

    def compute(self, failures: int) -> float:
        self.failures.append(failures)
        return self.delay


def toks(seed: int, n: int = 44) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, n)]


def payload(i: int) -> bytes:
    return bytes([i % 256]) * 40 + i.to_bytes(4, "little")


def test_round_trip_is_byte_exact(open_server: Server) -> None:
    tokens = toks(1)  # 5 full blocks of 8, and a partial tail of 4
    with SessionCacheClient(open_server.url, namespace=NS) as c:
        assert c.lookup(tokens).matched_blocks == 0
        stored = c.store(tokens, payload)
        assert stored.hashes == block_hashes(NS, tokens) == c.block_hashes(tokens)
        assert stored.missing == stored.hashes and stored.stored == 5
        again = c.store(tokens, [b"unused"] * 5)  # nothing missing: nothing read or uploaded
        assert again.missing == [] and again.stored == 0
        found = c.lookup(tokens[:30], lease_ms=5_000)  # 3 full blocks
        assert found.matched_blocks == 3 and found.matched_tokens == 24
        assert found.hashes == stored.hashes[:3] and found.lease is not None
        assert c.load(stored.hashes) == [payload(i) for i in range(5)]
        c.release(found.lease.id)
        with pytest.raises(LeaseNotFound) as info:
            c.release(found.lease.id)
        assert info.value.status == 404 and isinstance(info.value, SessionCacheError)
        assert c.load([]) == []
        missing = bytes(16)
        assert c.load([stored.hashes[0], missing]) == [payload(0), None]


def test_store_with_a_numpy_prompt_and_a_partial_hit(open_server: Server) -> None:
    tokens = np.asarray(toks(2, 32), dtype=np.int32)
    with SessionCacheClient(open_server.url, namespace=NS) as c:
        c.store(tokens[:16], payload)
        calls: list[int] = []

        def provide(i: int) -> bytes:
            calls.append(i)
            return payload(i)

        result = c.store(tokens, provide)
        assert calls == [2, 3] and result.stored == 2
        assert c.lookup(tokens).matched_blocks == 4


def test_sessions(open_server: Server) -> None:
    tokens = toks(3, 24)
    with SessionCacheClient(open_server.url, namespace=NS) as c:
        s = c.open_session(kind="chat", ttl_s=600)
        assert s.kind == "chat" and s.ttl_s == 600 and s.head is None
        assert c.open_session(s.id, kind="chat").id == s.id
        stored = c.store(tokens, payload, session_id=s.id)
        assert c.lookup(tokens, session_id=s.id).matched_blocks == 3
        got = c.get_session(s.id)
        assert got.head == stored.hashes[-1]
        assert c.extend_session(s.id, ttl_s=1200).ttl_s == 1200
        assert s.id in [x.id for x in c.list_sessions()]
        c.close_session(s.id)
        with pytest.raises(SessionNotFound):
            c.get_session(s.id)
        with pytest.raises(SessionNotFound):
            c.store(tokens, payload, session_id=s.id)


def test_errors_are_mapped_and_4xx_not_retried(open_server: Server) -> None:
    backoff = Recording()
    bad = replace(NS, model="m" * 600)  # valid locally, beyond the server's limit
    with SessionCacheClient(open_server.url, namespace=bad, retry=Retry(backoff, 5)) as c:
        with pytest.raises(InvalidRequest) as info:
            c.lookup(toks(4))
        assert info.value.status == 422 and isinstance(info.value, InvalidInput)
    with SessionCacheClient(open_server.url, namespace=NS, retry=Retry(backoff, 5)) as c:
        with pytest.raises(CoreBlockNotFound):  # the core class catches the client's
            c._send(Request("GET", "/v1/blocks/" + "0" * 32))
        with pytest.raises(UploadRefused):
            c._send(Request("PUT", "/v1/blocks/" + "1" * 32, content=b"x"))
        with pytest.raises(InvalidInput):  # checked locally, never sent
            c.lookup([-1, 2, 3])
        with pytest.raises(InvalidInput):
            c.store(toks(5, 16), [payload(0)])  # one payload for two blocks
    assert backoff.failures == []


def test_id_mismatch_is_detected(open_server: Server) -> None:
    tokens = toks(6)
    with (
        SessionCacheClient(open_server.url, namespace=NS) as good,
        SessionCacheClient(open_server.url, namespace=NS, seed=1) as other_seed,
    ):
        with pytest.raises(IdMismatch):
            other_seed.store(tokens, payload)  # the plan lists every id: always checked
        # a lookup can only check the ids it matched: none yet
        assert other_seed.lookup(tokens).matched_blocks == 0
        good.store(tokens, payload)
        with pytest.raises(IdMismatch):
            other_seed.lookup(tokens)


def test_auth_salts_with_the_tenant(auth_server: Server) -> None:
    tokens = toks(7)
    backoff = Recording()
    anon = SessionCacheClient(auth_server.url, namespace=NS, retry=Retry(backoff, 5))
    with anon, pytest.raises(AuthError):
        anon.lookup(tokens)
    with (
        SessionCacheClient(
            auth_server.url, namespace=NS, api_key="nope", retry=Retry(backoff, 5)
        ) as c,
        pytest.raises(AuthError),
    ):
        c.lookup(tokens)
    assert backoff.failures == []

    with SessionCacheClient(auth_server.url, namespace=NS, api_key="k") as c:
        who = c.whoami()
        assert (who.tenant, who.auth) == ("t", True)
        stored = c.store(tokens, payload)
        assert stored.hashes == block_hashes(replace(NS, salt="t"), tokens)
        assert stored.hashes != block_hashes(NS, tokens)
        found = c.lookup(tokens)
        assert found.matched_blocks == 5
        assert c.load(found.hashes) == [payload(i) for i in range(5)]
    salted = replace(NS, salt="team-1")
    with SessionCacheClient(auth_server.url, namespace=salted, api_key="k") as c:
        assert c.store(tokens, payload).hashes == block_hashes(replace(NS, salt="t/team-1"), tokens)
        c._effective = salted  # forget the tenant: the server's ids then differ from ours
        with pytest.raises(IdMismatch):
            c.store(tokens, payload)


def test_whoami_is_fetched_once(auth_server: Server) -> None:
    with SessionCacheClient(auth_server.url, namespace=NS, api_key="k") as c:
        paths: list[str] = []
        c._http.event_hooks["request"].append(lambda r: paths.append(r.url.path))
        for seed in (8, 9):
            c.lookup(toks(seed))
        assert paths == ["/v1/whoami", "/v1/lookup", "/v1/lookup"]


# -- the async mirror ------------------------------------------------------------------------


PUBLIC = [
    "whoami",
    "block_hashes",
    "resolve",
    "lookup",
    "lookup_by_id",
    "load",
    "store",
    "release",
    "open_session",
    "get_session",
    "extend_session",
    "close_session",
    "list_sessions",
    "close",
]


def test_async_api_mirrors_the_sync_one() -> None:
    def public(cls: type) -> set[str]:
        return {n for n in dir(cls) if not n.startswith("_")} - {"base_url", "namespace", "seed"}

    assert public(SessionCacheClient) == public(AsyncSessionCacheClient) >= set(PUBLIC)
    for name in [*PUBLIC, "__init__"]:
        sync_sig = inspect.signature(getattr(SessionCacheClient, name))
        async_sig = inspect.signature(getattr(AsyncSessionCacheClient, name))
        assert [(p.name, p.kind, p.default) for p in sync_sig.parameters.values()] == [
            (p.name, p.kind, p.default) for p in async_sig.parameters.values()
        ], name
        if name != "__init__":
            assert inspect.iscoroutinefunction(getattr(AsyncSessionCacheClient, name)), name


def script_sync(c: SessionCacheClient, tokens: list[int]) -> list[Any]:
    out: list[Any] = [c.whoami(), c.block_hashes(tokens), c.lookup(tokens)]
    out.append(c.store(tokens, payload))
    found = c.lookup(tokens, lease_ms=2_000)
    assert found.lease is not None
    out += [found.hashes, found.tiers, c.load([*found.hashes, bytes(16)])]
    c.release(found.lease.id)
    s = c.open_session(kind="agent", ttl_s=100)
    out.append(c.store(tokens + [1] * 8, payload, session_id=s.id))
    out.append(c.get_session(s.id).head)
    c.close_session(s.id)
    for call in (lambda: c.get_session(s.id), lambda: c.release(found.lease.id)):  # type: ignore[union-attr]
        try:
            call()
        except SessionCacheError as exc:
            out.append(type(exc))
    return out


async def script_async(c: AsyncSessionCacheClient, tokens: list[int]) -> list[Any]:
    out: list[Any] = [await c.whoami(), await c.block_hashes(tokens), await c.lookup(tokens)]
    out.append(await c.store(tokens, payload))
    found = await c.lookup(tokens, lease_ms=2_000)
    assert found.lease is not None
    out += [found.hashes, found.tiers, await c.load([*found.hashes, bytes(16)])]
    await c.release(found.lease.id)
    s = await c.open_session(kind="agent", ttl_s=100)
    out.append(await c.store(tokens + [1] * 8, payload, session_id=s.id))
    out.append((await c.get_session(s.id)).head)
    await c.close_session(s.id)
    for call in (lambda: c.get_session(s.id), lambda: c.release(found.lease.id)):  # type: ignore[union-attr]
        try:
            await call()
        except SessionCacheError as exc:
            out.append(type(exc))
    return out


def test_async_client_gives_the_same_results(open_server: Server) -> None:
    tokens = toks(10)
    ns_sync = replace(NS, model="mirror-sync")
    ns_async = replace(NS, model="mirror-async")
    with SessionCacheClient(open_server.url, namespace=ns_sync) as c:
        got_sync = script_sync(c, tokens)

    async def main() -> tuple[list[Any], Any]:
        async with AsyncSessionCacheClient(open_server.url, namespace=ns_async) as a:
            out = await script_async(a, tokens)
        async with AsyncSessionCacheClient(open_server.url, namespace=ns_sync) as a:
            return out, await a.lookup(tokens)

    got_async, cross = asyncio.run(main())
    # the same script in two namespaces: equal up to the ids, which are each namespace's own
    assert got_sync[1] == block_hashes(ns_sync, tokens)
    assert got_async[1] == block_hashes(ns_async, tokens)
    assert len(got_sync) == len(got_async)
    for a, b in zip(got_sync, got_async, strict=True):
        assert type(a) is type(b)
    assert got_sync[2].matched_blocks == got_async[2].matched_blocks == 0
    assert [got_sync[3].stored, got_async[3].stored] == [5, 5]
    assert got_sync[5] == got_async[5] and got_sync[6] == got_async[6]
    assert got_sync[7].stored == got_async[7].stored == 1
    assert got_sync[-2:] == got_async[-2:] == [SessionNotFound, LeaseNotFound]
    # and the async client reads exactly what the sync one wrote
    assert cross.hashes == got_sync[3].hashes
