"""A catalog read whose PostgreSQL backend is terminated after the pool handed the connection
out (its pre-ping passed) is retried on a new connection, not failed: a node's request must not
answer 500 because an administrator or a failover ended one backend."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, event, text

from sessioncache.catalog import Catalog
from sessioncache.sessions.manager import Session
from tests.sessioncache.catalog.conftest import Database, postgres_url


@pytest.fixture
def terminate_next_select() -> Iterator[Callable[[Catalog, str], list[int]]]:
    """Arm a catalog so that its next statement naming ``table`` finds its backend
    terminated (``pg_terminate_backend`` from another connection, just before it runs)."""
    admin = create_engine(postgres_url(), isolation_level="AUTOCOMMIT")

    def arm(catalog: Catalog, table: str) -> list[int]:
        killed: list[int] = []

        def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if not killed and table in statement:
                pid = conn.connection.dbapi_connection.info.backend_pid
                with admin.connect() as other:
                    other.execute(text("select pg_terminate_backend(:pid)"), {"pid": pid})
                killed.append(pid)

        event.listen(catalog.engine, "before_cursor_execute", before)
        return killed

    yield arm
    admin.dispose()


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)  # backends are PostgreSQL's
def test_a_session_read_survives_its_backend_being_terminated(
    migrated: Database, terminate_next_select: Callable[[Catalog, str], list[int]]
) -> None:
    catalog = migrated.catalog()
    catalog.sessions.create_session(Session("s-1", "default", "agent", 60.0, 1.0, 1.0, 61.0))
    killed = terminate_next_select(catalog, "FROM sessions")
    session = catalog.sessions.load_session(("default", "s-1"))
    assert killed and session is not None and session.id == "s-1"


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
def test_a_session_write_survives_its_backend_being_terminated(
    migrated: Database, terminate_next_select: Callable[[Catalog, str], list[int]]
) -> None:
    catalog = migrated.catalog()
    killed = terminate_next_select(catalog, "INSERT INTO sessions")
    catalog.sessions.create_session(Session("s-2", "default", "agent", 60.0, 1.0, 1.0, 61.0))
    session = catalog.sessions.load_session(("default", "s-2"))
    assert killed and session is not None and session.expires_at == 61.0
