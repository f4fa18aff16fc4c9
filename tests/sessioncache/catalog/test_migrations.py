"""Migrations: upgrade from empty, downgrade/upgrade round trip, models in step, the command."""

from __future__ import annotations

import argparse
import json

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from sessioncache.catalog import Catalog, CatalogNotMigrated, make_engine
from sessioncache.catalog import migrate as migrations
from sessioncache.catalog.models import Base
from sessioncache.commands import db as db_command
from sessioncache.errors import InvalidInput

TABLES = {"namespaces", "blocks", "sessions", "usage_counters"}


def tables(db) -> set[str]:
    engine = db.engine()
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_from_empty_creates_the_tables(db):
    assert migrations.current(db.url, schema=db.schema) is None
    assert not tables(db) & TABLES
    migrations.upgrade(db.url, schema=db.schema)
    assert tables(db) >= TABLES | {"alembic_version"}
    assert migrations.current(db.url, schema=db.schema) == migrations.head() == "0003"
    assert migrations.is_current(db.url, schema=db.schema)


def test_downgrade_and_upgrade_round_trip(db):
    migrations.upgrade(db.url, schema=db.schema)
    catalog = db.catalog()
    catalog.record_usage("hits", 3, at=0.0)
    catalog.flush()
    catalog.close()
    migrations.downgrade(db.url, "base", schema=db.schema)
    assert migrations.current(db.url, schema=db.schema) is None
    assert not tables(db) & TABLES
    migrations.upgrade(db.url, schema=db.schema)
    assert tables(db) >= TABLES
    assert migrations.current(db.url, schema=db.schema) == migrations.head()
    assert db.catalog().usage(0.0) == []  # a fresh schema


def test_models_match_the_migrations(migrated):
    engine = migrated.engine()
    with engine.connect() as conn:
        diffs = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diffs == []


def test_a_schema_holds_everything_on_postgres_only(db):
    if db.kind == "sqlite":
        with pytest.raises(InvalidInput, match="PostgreSQL"):
            make_engine(db.url, schema="elsewhere")
        return
    migrations.upgrade(db.url, schema=db.schema)
    engine = db.engine()
    assert set(inspect(engine).get_table_names(schema=db.schema)) >= TABLES | {"alembic_version"}
    with pytest.raises(InvalidInput, match="identifier"):
        make_engine(db.url, schema="x; drop table blocks")


def test_open_refuses_an_unmigrated_database_unless_asked(db):
    with pytest.raises(CatalogNotMigrated, match="db upgrade"):
        Catalog.open(db.url, schema=db.schema)
    catalog = db.catalog(migrate=True)
    assert catalog.count_blocks() == 0
    assert migrations.is_current(db.url, schema=db.schema)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="sessioncache")
    sub = root.add_subparsers(dest="command", required=True)
    db_command.register(sub)
    return root


def run(*argv: str) -> int:
    args = parser().parse_args(list(argv))
    return int(args.func(args))


def test_db_command_upgrade_current_downgrade(db, capsys):
    target = ["--url", db.url] + (["--schema", db.schema] if db.schema else [])
    assert run("db", "current", *target) == 0
    assert "at revision None (head is 0003)" in capsys.readouterr().out
    assert run("db", "upgrade", *target) == 0
    assert "at revision 0003" in capsys.readouterr().out
    assert tables(db) >= TABLES
    assert run("db", "current", *target) == 0
    assert "at revision 0003 (up to date)" in capsys.readouterr().out
    assert run("db", "downgrade", "base", *target) == 0
    assert "at revision None" in capsys.readouterr().out
    assert not tables(db) & TABLES


def test_db_command_defaults_to_sqlite_under_the_data_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SESSIONCACHE_DATABASE_URL", raising=False)
    monkeypatch.delenv("SESSIONCACHE_CONFIG", raising=False)
    monkeypatch.setenv("SESSIONCACHE_DATA_DIR", str(tmp_path / "data"))
    assert run("db", "upgrade") == 0
    assert (tmp_path / "data" / "catalog.db").exists()
    assert migrations.current(f"sqlite:///{tmp_path / 'data' / 'catalog.db'}") == "0003"


def test_url_precedence(tmp_path, monkeypatch):
    from sessioncache.catalog import default_url, resolve_url

    monkeypatch.delenv("SESSIONCACHE_DATABASE_URL", raising=False)
    monkeypatch.delenv("SESSIONCACHE_DATA_DIR", raising=False)
    assert resolve_url().endswith("/.sessioncache/catalog.db")
    monkeypatch.setenv("SESSIONCACHE_DATA_DIR", str(tmp_path))
    assert resolve_url() == default_url(tmp_path) == f"sqlite:///{tmp_path / 'catalog.db'}"
    monkeypatch.setenv("SESSIONCACHE_DATABASE_URL", "postgresql+psycopg://u@h/db")
    assert resolve_url() == "postgresql+psycopg://u@h/db"
    assert resolve_url("sqlite:///x.db") == "sqlite:///x.db"


def test_upgrade_to_0002_keeps_a_catalog_and_fills_each_namespace_tenant(db):
    migrations.upgrade(db.url, schema=db.schema, revision="0001")
    engine = db.engine()
    owned = {"tenant": "alice", "namespace": {"model": "m"}}
    with engine.begin() as conn:
        conn.execute(
            text("INSERT INTO namespaces (root, description, created) VALUES (:r, :d, 0)"),
            [{"r": b"\x01" * 16, "d": json.dumps(owned)}, {"r": b"\x02" * 16, "d": None}],
        )
    migrations.upgrade(db.url, schema=db.schema)
    with engine.connect() as conn:
        rows = dict(conn.execute(text("SELECT root, tenant FROM namespaces")).all())
    engine.dispose()
    assert {bytes(k): v for k, v in rows.items()} == {b"\x01" * 16: "alice", b"\x02" * 16: None}
    catalog = db.catalog()
    assert catalog.namespaces()[b"\x01" * 16] == owned  # the description is as it was
    catalog.close()


def test_upgrade_to_0003_keys_sessions_by_tenant_and_keeps_them(db):
    migrations.upgrade(db.url, schema=db.schema, revision="0002")
    engine = db.engine()
    row = "(:id, :tenant, 'agent', 60, 0, :seen, 1e12, NULL)"
    insert = text(
        "INSERT INTO sessions (id, tenant, kind, ttl_s, created, last_seen, expires_at, head)"
        f" VALUES {row}"
    )
    with engine.begin() as conn:
        conn.execute(insert, [{"id": "s1", "tenant": "alice", "seen": 1.0}])
    migrations.upgrade(db.url, schema=db.schema)
    key = inspect(engine).get_pk_constraint("sessions", schema=db.schema)
    assert sorted(key["constrained_columns"]) == ["id", "tenant"]
    with engine.begin() as conn:  # bob's s1 beside alice's
        conn.execute(insert, [{"id": "s1", "tenant": "bob", "seen": 2.0}])
    catalog = db.catalog()
    assert {(s.tenant, s.id) for s in catalog.sessions.load_sessions()} == {
        ("alice", "s1"),
        ("bob", "s1"),
    }
    assert catalog.sessions.load_session(("alice", "s1")).last_seen == 1.0
    catalog.close()
    migrations.downgrade(db.url, "0002", schema=db.schema)  # one row per id: the latest
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT tenant, id FROM sessions")).all()
    engine.dispose()
    assert [tuple(r) for r in rows] == [("bob", "s1")]
