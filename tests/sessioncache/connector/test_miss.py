"""``LookupResult.miss`` and ``Session.attribution`` through the connector (sync and async)."""

from __future__ import annotations

import asyncio

import numpy as np

from sessioncache.connector import AsyncSessionCacheClient, SessionCacheClient
from tests.support.servers import Server

from .conftest import NS


def toks(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, n)]


def payload(i: int) -> bytes:
    return bytes([i % 256]) * 44


def test_miss_says_where_an_edited_prompt_diverged(open_server: Server) -> None:
    first = toks(100, 48)  # 6 blocks of 8
    with SessionCacheClient(open_server.url, namespace=NS) as c:
        s = c.open_session()
        c.store(first, payload, session_id=s.id)
        edited = [*first[:19], first[19] + 1, *first[20:], *toks(101, 10)]
        assert c.lookup(edited, session_id=s.id).miss is None  # not asked
        found = c.lookup(edited, session_id=s.id, explain=True)
        miss = found.miss
        assert found.matched_blocks == 2 and miss is not None
        assert (miss.reason, miss.block, miss.offset, miss.token) == ("diverged", 2, 3, 19)
        assert miss.tokens == {"diverged": 32, "evicted": 0, "expired": 0, "new": 10, "declined": 0}
        by_id = c.lookup_by_id(edited, session_id=s.id, explain=True).miss
        assert by_id is not None and by_id.reason == "diverged" and by_id.offset is None
        totals = c.get_session(s.id).attribution
        assert totals is not None and totals.lookups == 3
        assert totals.last_divergence == (2, 3, 19)  # kept: the id lookup knows no offset
        assert sum(totals.miss_tokens.values()) == 42 + 42 + 40

        async def fresh() -> None:
            async with AsyncSessionCacheClient(open_server.url, namespace=NS) as a:
                found = await a.lookup(toks(102, 20), explain=True)
                assert found.miss is not None and found.miss.reason == "new"
                assert found.miss.tokens["new"] == 20

        asyncio.run(fresh())


def test_a_declined_lookup_matches_nothing_and_says_why(open_server: Server) -> None:
    prompt = toks(103, 48)  # 6 blocks of 8
    with SessionCacheClient(open_server.url, namespace=NS) as c:
        s = c.open_session()
        c.store(prompt, payload, session_id=s.id)
        found = c.lookup(prompt + toks(104, 3), session_id=s.id, explain=True, declined=True)
        assert found.matched_blocks == 0 and found.lease is None and found.miss is not None
        assert found.miss.reason == "declined" and found.miss.tokens["declined"] == 48
        by_id = c.lookup_by_id(prompt, session_id=s.id, explain=True, declined=True)
        assert by_id.matched_blocks == 0 and by_id.miss is not None
        assert by_id.miss.tokens["declined"] == 48
        totals = c.get_session(s.id).attribution
        assert totals is not None and totals.hit_tokens == 0
        assert totals.miss_tokens["declined"] == 96 and totals.miss_tokens["new"] == 3
        assert c.lookup(prompt, session_id=s.id).matched_blocks == 6

        async def declined() -> None:
            async with AsyncSessionCacheClient(open_server.url, namespace=NS) as a:
                got = await a.lookup_by_id(prompt, explain=True, declined=True)
                assert got.matched_blocks == 0 and got.miss is not None
                assert got.miss.tokens["declined"] == 48

        asyncio.run(declined())
