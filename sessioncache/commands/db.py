"""``sessioncache db``: migrate the catalog (``upgrade``, ``downgrade``, ``current``).

The database is ``--url``, else the configured one (``Settings.catalog_url()``:
``$SESSIONCACHE_DATABASE_URL``, else SQLite at ``$SESSIONCACHE_DATA_DIR/catalog.db``).
"""

from __future__ import annotations

import argparse
from typing import Any


def _target(args: argparse.Namespace) -> tuple[str, str | None]:
    import os

    from sessioncache.config import Settings

    settings = Settings()
    url: str = args.url or settings.catalog_url()
    schema = (
        args.schema
        or getattr(settings, "database_schema", None)
        or os.environ.get("SESSIONCACHE_DATABASE_SCHEMA")
        or None
    )
    return url, schema


def _redacted(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def run_upgrade(args: argparse.Namespace) -> int:
    from sessioncache.catalog import migrate

    url, schema = _target(args)
    migrate.upgrade(url, schema=schema, revision=args.revision)
    print(f"{_redacted(url)}: at revision {migrate.current(url, schema=schema)}")
    return 0


def run_downgrade(args: argparse.Namespace) -> int:
    from sessioncache.catalog import migrate

    url, schema = _target(args)
    migrate.downgrade(url, args.revision, schema=schema)
    print(f"{_redacted(url)}: at revision {migrate.current(url, schema=schema)}")
    return 0


def run_current(args: argparse.Namespace) -> int:
    from sessioncache.catalog import migrate

    url, schema = _target(args)
    at = migrate.current(url, schema=schema)
    head = migrate.head()
    state = "up to date" if at == head else f"head is {head}"
    print(f"{_redacted(url)}: at revision {at} ({state})")
    return 0


def register(sub: Any) -> None:
    parser = sub.add_parser("db", help="migrate the catalog database")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url",
        default=None,
        help="database URL (default: $SESSIONCACHE_DATABASE_URL, else SQLite under the "
        "data directory)",
    )
    common.add_argument(
        "--schema",
        default=None,
        help="PostgreSQL schema (default: $SESSIONCACHE_DATABASE_SCHEMA, else the search path)",
    )
    actions = parser.add_subparsers(dest="db_command", required=True)
    up = actions.add_parser("upgrade", parents=[common], help="migrate up (default: to head)")
    up.add_argument("revision", nargs="?", default="head")
    up.set_defaults(func=run_upgrade)
    down = actions.add_parser("downgrade", parents=[common], help="migrate down to REVISION")
    down.add_argument("revision", help='target revision ("base" drops every table)')
    down.set_defaults(func=run_downgrade)
    cur = actions.add_parser("current", parents=[common], help="print the current revision")
    cur.set_defaults(func=run_current)
