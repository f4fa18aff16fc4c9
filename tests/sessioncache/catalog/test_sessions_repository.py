"""The catalog as a SessionRepository: create/delete durable at once, save written behind."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from sqlalchemy import select

from sessioncache.catalog.models import sessions_table
from sessioncache.clock import ManualClock
from sessioncache.hashing import BlockHash, Namespace, block_hashes
from sessioncache.sessions.manager import Session, SessionManager
from sessioncache.store import TieredStore
from sessioncache.tiers.disk import DiskTier

NS = Namespace("test-model", 4, "float16", "test-layout")
HEAD = BlockHash(bytes(range(16)))


def session(sid: str = "s1", head: BlockHash | None = HEAD) -> Session:
    return Session(
        id=sid,
        tenant="acme",
        kind="agent",
        ttl_s=3600.0,
        created=1000.0,
        last_seen=1000.5,
        expires_at=4600.5,
        head=head,
    )


def stored(catalog, sid: str):
    with catalog.engine.connect() as conn:
        return conn.execute(select(sessions_table).where(sessions_table.c.id == sid)).first()


def test_round_trip_create_save_delete_load(make_catalog):
    catalog = make_catalog()
    s1, s2 = session("s1"), session("s2", head=None)
    catalog.sessions.create_session(s1)
    catalog.sessions.create_session(s2)
    assert stored(catalog, "s1") is not None  # durable without a flush
    assert catalog.sessions.load_sessions() == [s1, s2]

    later = replace(s1, last_seen=2000.0, expires_at=5600.0, head=BlockHash(b"\xff" * 16))
    catalog.sessions.save_session(later)
    assert stored(catalog, "s1").last_seen == 1000.5  # written behind
    catalog.flush()
    assert stored(catalog, "s1").last_seen == 2000.0
    assert catalog.sessions.load_sessions() == [later, s2]

    catalog.sessions.delete_session(("acme", "s2"))
    assert stored(catalog, "s2") is None
    assert [s.id for s in catalog.sessions.load_sessions()] == ["s1"]


def test_load_sees_pending_saves(make_catalog):
    catalog = make_catalog()
    catalog.sessions.create_session(session())
    catalog.sessions.save_session(replace(session(), head=None, ttl_s=10.0))
    [loaded] = catalog.sessions.load_sessions()
    assert loaded.head is None and loaded.ttl_s == 10.0


def test_a_deleted_session_is_not_revived_by_a_pending_save(make_catalog):
    catalog = make_catalog()
    catalog.sessions.create_session(session())
    catalog.sessions.save_session(replace(session(), last_seen=3000.0))
    catalog.sessions.delete_session(("acme", "s1"))
    catalog.flush()
    assert catalog.sessions.load_sessions() == []
    # Saves are updates: one for a session that is gone writes nothing.
    catalog.sessions.save_session(session())
    catalog.flush()
    assert catalog.sessions.load_sessions() == []


def test_create_overwrites_a_stale_row(make_catalog):
    catalog = make_catalog()
    catalog.sessions.create_session(session())
    fresh = replace(session(), kind="chat", created=9000.0, head=None)
    catalog.sessions.create_session(fresh)
    assert catalog.sessions.load_sessions() == [fresh]


def test_session_manager_restores_from_the_catalog(make_catalog, tmp_path):
    clock = ManualClock()
    catalog = make_catalog(clock=clock)
    store = TieredStore(
        [DiskTier.open(tmp_path / "disk", 1 << 24, fsync=False)], clock=clock, observers=[catalog]
    )
    manager = SessionManager(store, repository=catalog.sessions)
    hashes = block_hashes(NS, np.arange(5 * NS.block_tokens))
    a = manager.open("a", tenant="t1")
    store.writes.put(hashes, [bytes(64)] * 5, namespace_root=NS.root(), durable=True)
    manager.record("a", hashes, tenant="t1")
    manager.open("b", kind="chat")
    manager.open("gone")
    manager.close("gone")
    catalog.close()
    store.close()

    catalog = make_catalog(clock=clock)
    store = TieredStore([DiskTier.open(tmp_path / "disk", 1 << 24)], clock=clock)
    manager = SessionManager(store, repository=catalog.sessions)
    assert manager.restore() == 2
    restored = manager.get("a", tenant="t1")
    assert (restored.tenant, restored.head, restored.created) == ("t1", hashes[-1], a.created)
    assert manager.get("b").kind == "chat"
    assert manager.lookup("a", hashes, tenant="t1").num_blocks == 5
    # Expired sessions are dropped from the catalog on restore.
    clock.advance(8 * 86400.0)
    manager = SessionManager(store, repository=catalog.sessions)
    assert manager.restore() == 0
    assert catalog.sessions.load_sessions() == []
    store.close()
