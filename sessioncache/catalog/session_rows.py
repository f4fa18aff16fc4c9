"""The catalog's session rows: ``SessionRepository`` over the catalog's database. Opens and
closes are written at once (durable when they return); the sliding TTL and head of every
request are queued with the catalog's block rows and written behind by its flusher."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import ColumnElement, delete, func, or_, select

from sessioncache.catalog.health import CatalogHealth, answered
from sessioncache.catalog.models import sessions_table
from sessioncache.catalog.retry import retried_on_disconnect
from sessioncache.hashing import BlockHash
from sessioncache.sessions.manager import Session, SessionKey
from sessioncache.sessions.query import SessionPage, SessionQuery

if TYPE_CHECKING:
    from sessioncache.catalog.repository import Catalog


class SessionRows:
    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog

    @property
    def health(self) -> CatalogHealth:
        return self._catalog.health

    @answered
    @retried_on_disconnect
    def create_session(self, session: Session) -> None:
        """Insert (or overwrite) the session's row; durable when this returns."""
        with self._catalog._qlock:
            self._catalog._pending.sessions.pop(session.key, None)
        params = session_params(session)
        with self._catalog._writer.transaction() as conn:
            conn.execute(self._catalog._stmts.upsert_session, [params])

    def save_session(self, session: Session) -> None:
        """Queue the session's new expiry and head (an update of its existing row)."""
        with self._catalog._qlock:
            self._catalog._pending.sessions[session.key] = session
            size = len(self._catalog._pending.sessions)
        if size >= self._catalog._max_pending:
            self._catalog._flusher.wake()

    @answered
    @retried_on_disconnect
    def delete_session(self, key: SessionKey) -> None:
        """Delete the session's row; durable when this returns."""
        with self._catalog._qlock:
            self._catalog._pending.sessions.pop(key, None)
        with self._catalog._writer.transaction() as conn:
            conn.execute(delete(sessions_table).where(*_is(key)))

    @answered
    @retried_on_disconnect
    def load_sessions(self) -> list[Session]:
        """Every stored session (pending saves are flushed first)."""
        self._catalog.flush()
        t = sessions_table
        with self._catalog.engine.connect() as conn:
            rows = conn.execute(select(t).order_by(t.c.created, t.c.tenant, t.c.id)).all()
        return [session_of(r) for r in rows]

    @answered
    @retried_on_disconnect
    def load_session(self, key: SessionKey) -> Session | None:
        """One stored session, e.g. opened through another node sharing this catalog."""
        with self._catalog.engine.connect() as conn:
            row = conn.execute(select(sessions_table).where(*_is(key))).first()
        return session_of(row) if row is not None else None

    @answered
    @retried_on_disconnect
    def query_sessions(self, query: SessionQuery, *, now: float) -> SessionPage:
        """One page of the unexpired sessions, searched and sorted in SQL (``SessionSearch``;
        pending saves are flushed first, so last-seen times are current)."""
        self._catalog.flush()
        t = sessions_table
        where = [t.c.expires_at > now]
        if query.tenant is not None:
            where.append(t.c.tenant == query.tenant)
        if query.search:
            needle = query.search.lower()
            where.append(
                or_(
                    func.lower(t.c.id).contains(needle, autoescape=True),
                    func.lower(t.c.tenant).contains(needle, autoescape=True),
                )
            )
        column = t.c[query.sort]
        ties = [t.c.id, t.c.tenant]
        order = [column.desc(), *(c.desc() for c in ties)] if query.descending else [column, *ties]
        with self._catalog.engine.connect() as conn:
            total = conn.execute(select(func.count()).select_from(t).where(*where)).scalar_one()
            rows = conn.execute(
                select(t).where(*where).order_by(*order).offset(query.offset).limit(query.limit)
            ).all()
        return SessionPage(int(total), [session_of(r) for r in rows])


def _is(key: SessionKey) -> tuple[ColumnElement[bool], ColumnElement[bool]]:
    """The row of the session ``key`` (tenant, id)."""
    return sessions_table.c.tenant == key[0], sessions_table.c.id == key[1]


def session_params(s: Session) -> dict[str, Any]:
    """The session's row: its value of each column of ``sessions_table``."""
    row = {c.name: getattr(s, c.name) for c in sessions_table.columns}
    row["head"] = bytes(s.head) if s.head is not None else None
    return row


def session_of(r: Any) -> Session:
    return Session(
        id=r.id,
        tenant=r.tenant,
        kind=r.kind,
        ttl_s=float(r.ttl_s),
        created=float(r.created),
        last_seen=float(r.last_seen),
        expires_at=float(r.expires_at),
        head=BlockHash(bytes(r.head)) if r.head is not None else None,
    )
