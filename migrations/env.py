"""Alembic environment: run by ``sessioncache.catalog.migrate`` (``sessioncache db ...``).

The caller passes an open connection and an optional PostgreSQL schema through
``config.attributes``; run by the ``alembic`` tool instead, the URL comes from the
``sqlalchemy.url`` option or ``$SESSIONCACHE_DATABASE_URL``.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from sessioncache.catalog.db import check_schema, make_engine, resolve_url
from sessioncache.catalog.models import Base

config = context.config
target_metadata = Base.metadata
schema: str | None = config.attributes.get("schema")


# Serialises concurrent migrations of one PostgreSQL database (several replicas starting at
# once); held until the migration's transaction ends.
_ADVISORY_LOCK = 0x5E55_CA7A


def _configure(connection: Connection) -> None:
    if connection.dialect.name == "postgresql":
        connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_ADVISORY_LOCK})")
        if schema is not None:
            connection.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{check_schema(schema)}"')
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        version_table_schema=schema,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_offline() -> None:
    context.configure(
        url=resolve_url(config.get_main_option("sqlalchemy.url")),
        target_metadata=target_metadata,
        version_table_schema=schema,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        return
    engine = make_engine(resolve_url(config.get_main_option("sqlalchemy.url")), schema=schema)
    try:
        with engine.begin() as conn:
            _configure(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
