"""Paging the sessions: the catalog pages in SQL (SQLite and PostgreSQL) with exactly the
semantics of the in-memory pager, and the manager uses whichever it has."""

from __future__ import annotations

import pytest

from sessioncache.clock import ManualClock
from sessioncache.errors import InvalidInput
from sessioncache.sessions.manager import Session, SessionManager
from sessioncache.sessions.query import SORT_KEYS, SessionQuery, page_in_memory
from sessioncache.store import TieredStore
from sessioncache.tiers.cpu import CpuTier

TENANTS = ("acme", "globex", "Initech")


def sessions(now: float) -> list[Session]:
    out = []
    for i in range(23):
        out.append(
            Session(
                id=f"s{i:02d}" + ("_x%" if i == 7 else ""),
                tenant=TENANTS[i % 3],
                kind="agent" if i % 2 else "chat",
                ttl_s=3600.0,
                created=now - 100 + (i * 7) % 23,  # ties in no column but id
                last_seen=now - (i % 5),  # ties: broken by id
                expires_at=now + 10 * i - 15,  # the first two have expired
            )
        )
    return out


QUERIES = [
    SessionQuery(),
    SessionQuery(sort="id", descending=False, limit=5),
    SessionQuery(sort="id", descending=False, offset=5, limit=5),
    SessionQuery(sort="tenant", offset=3, limit=4),
    SessionQuery(sort="created", descending=False, limit=100),
    SessionQuery(sort="expires_at", limit=3),
    SessionQuery(sort="kind", descending=False),
    SessionQuery(search="INITECH", sort="id"),
    SessionQuery(search="s1", sort="last_seen", descending=False),
    SessionQuery(search="_x%", sort="id"),  # LIKE wildcards are literal
    SessionQuery(search="%", sort="id"),
    SessionQuery(tenant="acme", sort="id", limit=2, offset=2),
    SessionQuery(offset=40),
]


def ids(page) -> list[str]:
    return [s.id for s in page.sessions]


def test_sql_pages_as_memory_does(make_catalog):
    now = 10_000.0
    catalog = make_catalog()
    for s in sessions(now):
        catalog.sessions.create_session(s)
    for query in QUERIES:
        in_sql = catalog.sessions.query_sessions(query, now=now)
        in_memory = page_in_memory(sessions(now), query, now=now)
        assert (in_sql.total, ids(in_sql)) == (in_memory.total, ids(in_memory)), query
    assert catalog.sessions.query_sessions(SessionQuery(), now=now).total == 21  # two expired


def test_the_manager_pages_through_its_repository(make_catalog):
    catalog = make_catalog()
    clock = ManualClock(5000.0)
    store = TieredStore([CpuTier(1 << 20)], clock=clock)
    manager = SessionManager(store, repository=catalog.sessions)
    for i in range(4):
        manager.open(f"m{i}", tenant="acme")
        clock.advance(1)
    manager.extend("m0", tenant="acme")  # a write-behind save: paging flushes it first
    page = manager.page(SessionQuery(sort="last_seen", limit=2))
    assert page.total == 4 and ids(page) == ["m0", "m3"]
    without = SessionManager(TieredStore([CpuTier(1 << 20)], clock=clock))
    without.open("x", tenant="acme")
    assert ids(without.page(SessionQuery())) == ["x"]


@pytest.mark.parametrize(
    "kwargs",
    [{"sort": "pinned"}, {"offset": -1}, {"limit": 0}, {"limit": 501}, {"search": "x" * 201}],
)
def test_bad_queries(kwargs):
    with pytest.raises(InvalidInput):
        SessionQuery(**kwargs)


def test_sort_keys_are_columns():
    assert set(SORT_KEYS) <= set(Session.__dataclass_fields__)
