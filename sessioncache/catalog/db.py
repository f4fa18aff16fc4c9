"""Engines for the catalog: SQLite (embedded default) and PostgreSQL (production).

SQLite runs in WAL mode with ``synchronous=NORMAL`` (a committed transaction survives the death
of the process; the last ones may be lost on power failure) and foreign keys on. PostgreSQL may
be confined to one schema: ``search_path`` is set on every connection, so the tables and
Alembic's version table all live there (the tests give every test its own schema).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url

from sessioncache.errors import InvalidInput

DATABASE_URL_ENV = "SESSIONCACHE_DATABASE_URL"
DATA_DIR_ENV = "SESSIONCACHE_DATA_DIR"
DEFAULT_DATA_DIR = ".sessioncache"
CATALOG_FILE = "catalog.db"
SQLITE_BUSY_TIMEOUT_S = 30.0

_SCHEMA_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def default_url(data_dir: str | os.PathLike[str]) -> str:
    """The embedded catalog: SQLite at ``data_dir/catalog.db``."""
    path = (Path(data_dir).expanduser() / CATALOG_FILE).resolve()
    return f"sqlite:///{path}"


def resolve_url(url: str | None = None, data_dir: str | os.PathLike[str] | None = None) -> str:
    """``url`` if given, else ``$SESSIONCACHE_DATABASE_URL``, else SQLite under ``data_dir``
    (default ``$SESSIONCACHE_DATA_DIR`` or ``.sessioncache``)."""
    if url:
        return url
    env = os.environ.get(DATABASE_URL_ENV)
    if env:
        return env
    if data_dir is None:
        data_dir = os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR
    return default_url(data_dir)


def check_schema(schema: str) -> str:
    """A schema name safe to splice into SQL (a plain identifier)."""
    if not _SCHEMA_RE.match(schema):
        raise InvalidInput(f"a schema name is a plain SQL identifier, got {schema!r}")
    return schema


def make_engine(
    url: str | URL,
    *,
    schema: str | None = None,
    wait_s: float = SQLITE_BUSY_TIMEOUT_S,
    **kwargs: Any,
) -> Engine:
    """An engine for the catalog at ``url`` (see the module docstring).

    ``schema`` (PostgreSQL only) confines every connection to that schema via ``search_path``.
    ``wait_s`` bounds what a call waits for the database: SQLite's lock (its busy timeout),
    PostgreSQL's connect (at least 2 s: libpq's least), a connection of the pool.
    Extra keyword arguments go to ``sqlalchemy.create_engine``.
    """
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    connect_args: dict[str, Any] = dict(kwargs.pop("connect_args", {}))
    if backend == "sqlite":
        if schema is not None:
            raise InvalidInput("schema is only supported on PostgreSQL")
        database = parsed.database
        if database and database != ":memory:" and not database.startswith("file:"):
            Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
            kwargs.setdefault("pool_timeout", wait_s)  # a file's pool (memory's has none)
        connect_args.setdefault("check_same_thread", False)
        connect_args.setdefault("timeout", wait_s)
        engine = create_engine(parsed, connect_args=connect_args, **kwargs)
        event.listen(engine, "connect", _sqlite_on_connect)
        return engine
    if backend == "postgresql":
        if schema is not None:
            options = connect_args.get("options", "")
            connect_args["options"] = f"{options} -csearch_path={check_schema(schema)}".strip()
        connect_args.setdefault("connect_timeout", max(2, math.ceil(wait_s)))
        kwargs.setdefault("pool_timeout", wait_s)
        kwargs.setdefault("pool_pre_ping", True)
        return create_engine(parsed, connect_args=connect_args, **kwargs)
    if schema is not None:
        raise InvalidInput("schema is only supported on PostgreSQL")
    return create_engine(parsed, connect_args=connect_args, **kwargs)


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()
