"""Alembic, driven from code: no ``alembic.ini``; the scripts live in the ``migrations`` package.

``upgrade``/``downgrade``/``current`` take a URL or an ``Engine``; with a PostgreSQL ``schema``
the tables and the version table go into that schema (created if missing).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine
from sqlalchemy.engine import URL

from sessioncache.catalog.db import make_engine

VERSION_TABLE = "alembic_version"


def script_location() -> Path:
    """The folder of the Alembic environment (the ``migrations`` package)."""
    from sessioncache import migrations

    return Path(migrations.__file__).resolve().parent


def alembic_config(connection: Connection | None = None, schema: str | None = None) -> Config:
    """An Alembic ``Config`` built in code; ``env.py`` uses ``connection`` and ``schema``."""
    config = Config()
    config.set_main_option("script_location", str(script_location()))
    config.attributes["connection"] = connection
    config.attributes["schema"] = schema
    return config


def head() -> str:
    """The newest revision of the scripts."""
    revision = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if revision is None:
        raise RuntimeError("the migrations package has no revisions")
    return revision


def upgrade(url: str | URL | Engine, schema: str | None = None, revision: str = "head") -> None:
    """Migrate the catalog at ``url`` up to ``revision`` (from empty if need be)."""
    with _connection(url, schema) as conn:
        command.upgrade(alembic_config(conn, schema), revision)


def downgrade(url: str | URL | Engine, revision: str, schema: str | None = None) -> None:
    """Migrate the catalog at ``url`` down to ``revision`` (``"base"``: drop everything)."""
    with _connection(url, schema) as conn:
        command.downgrade(alembic_config(conn, schema), revision)


def current(url: str | URL | Engine, schema: str | None = None) -> str | None:
    """The revision the catalog at ``url`` is at (None when never migrated)."""
    with _connection(url, schema) as conn:
        context = MigrationContext.configure(
            conn, opts={"version_table": VERSION_TABLE, "version_table_schema": schema}
        )
        return context.get_current_revision()


def is_current(url: str | URL | Engine, schema: str | None = None) -> bool:
    """Whether the catalog is at the newest revision."""
    return current(url, schema) == head()


@contextmanager
def _connection(url: str | URL | Engine, schema: str | None) -> Iterator[Connection]:
    if isinstance(url, Engine):
        with url.begin() as conn:
            yield conn
        return
    engine = make_engine(url, schema=schema)
    try:
        with engine.begin() as conn:
            yield conn
    finally:
        engine.dispose()
