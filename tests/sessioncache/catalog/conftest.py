"""Every catalog test runs against SQLite (a file in tmp_path) and the real PostgreSQL server
at 127.0.0.1:5432 (database ``test``), each PostgreSQL test in a schema of its own that is
dropped afterwards, so runs never collide."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import OperationalError

from sessioncache.catalog import Catalog, make_engine
from sessioncache.catalog import migrate as migrations

PG_HOST = os.environ.get("SESSIONCACHE_TEST_PG_HOST", "127.0.0.1:5432")
PG_DB = os.environ.get("SESSIONCACHE_TEST_PG_DB", "test")
_pg_url: str | None = None


def postgres_url() -> str:
    """The first of users postgres, root that the server lets in."""
    global _pg_url
    if _pg_url is None:
        errors = []
        for user in ("postgres", "root"):
            url = f"postgresql+psycopg://{user}@{PG_HOST}/{PG_DB}"
            engine = create_engine(url)
            try:
                with engine.connect() as conn:
                    conn.execute(text("select 1"))
                _pg_url = url
                break
            except OperationalError as exc:
                errors.append(f"{user}: {exc}")
            finally:
                engine.dispose()
        else:
            raise RuntimeError(f"PostgreSQL at {PG_HOST}/{PG_DB} is unreachable: {errors}")
    return _pg_url


@dataclass
class Database:
    kind: str
    url: str
    schema: str | None
    _engines: list[Engine] = field(default_factory=list)
    _catalogs: list[Catalog] = field(default_factory=list)

    def engine(self) -> Engine:
        engine = make_engine(self.url, schema=self.schema)
        self._engines.append(engine)
        return engine

    def upgrade(self) -> None:
        migrations.upgrade(self.url, schema=self.schema)

    def catalog(self, **kwargs: Any) -> Catalog:
        catalog = Catalog.open(self.url, schema=self.schema, **kwargs)
        self._catalogs.append(catalog)
        return catalog

    def close(self) -> None:
        for catalog in self._catalogs:
            catalog.close()
        for engine in self._engines:
            engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """An empty database (not migrated)."""
    if request.param == "sqlite":
        database = Database("sqlite", f"sqlite:///{tmp_path / 'data' / 'catalog.db'}", None)
        yield database
        database.close()
        return
    url = postgres_url()
    schema = f"t_{uuid.uuid4().hex[:16]}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    database = Database("postgresql", url, schema)
    try:
        yield database
    finally:
        database.close()
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def migrated(db: Database) -> Database:
    db.upgrade()
    return db


@pytest.fixture
def make_catalog(migrated: Database) -> Callable[..., Catalog]:
    """Catalogs on the migrated database, closed after the test (flusher not started)."""
    return migrated.catalog
