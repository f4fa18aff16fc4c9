"""One page of the open sessions, searched and sorted: the dashboard's sessions table.

Sessions live in the catalog (SQL) when there is one, and a fleet's catalog holds every node's
sessions, so a ``SessionSearch`` (the catalog) pages in SQL: ``LIMIT``/``OFFSET`` over an
indexed order, never every row into Python. Without a catalog the manager pages its own
in-memory sessions with ``page_in_memory``, the same semantics.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, get_args, runtime_checkable

from sessioncache.errors import InvalidInput

if TYPE_CHECKING:  # sessions.py imports this module
    from sessioncache.sessions.manager import Session

SortKey = Literal["tenant", "id", "kind", "created", "last_seen", "expires_at"]
SORT_KEYS: tuple[str, ...] = get_args(SortKey)
MAX_PAGE = 500


@dataclass(frozen=True, slots=True)
class SessionQuery:
    search: str = ""
    """Case-insensitive substring of the session id or its tenant; empty: every session."""
    sort: SortKey = "last_seen"
    descending: bool = True
    offset: int = 0
    limit: int = 50
    tenant: str | None = None

    def __post_init__(self) -> None:
        if self.sort not in SORT_KEYS:
            raise InvalidInput(f"sort must be one of {list(SORT_KEYS)}, got {self.sort!r}")
        if self.offset < 0:
            raise InvalidInput("offset must not be negative")
        if not 0 < self.limit <= MAX_PAGE:
            raise InvalidInput(f"limit must be within 1..{MAX_PAGE}")
        if len(self.search) > 200:
            raise InvalidInput("search is at most 200 characters")


@dataclass(frozen=True, slots=True)
class SessionPage:
    total: int
    """Sessions matching the query, on every page."""
    sessions: list[Session]


@runtime_checkable
class SessionSearch(Protocol):
    """A session repository that pages itself (the catalog)."""

    def query_sessions(self, query: SessionQuery, *, now: float) -> SessionPage:
        """The unexpired sessions matching ``query``: the total and the page asked for."""
        ...


def page_in_memory(sessions: Iterable[Session], query: SessionQuery, *, now: float) -> SessionPage:
    needle = query.search.lower()
    found = [
        s
        for s in sessions
        if s.expires_at > now
        and (query.tenant is None or s.tenant == query.tenant)
        and (not needle or needle in s.id.lower() or needle in s.tenant.lower())
    ]
    # ties broken by id, as the SQL order is
    found.sort(key=lambda s: s.id, reverse=query.descending)
    found.sort(key=lambda s: getattr(s, query.sort), reverse=query.descending)
    return SessionPage(len(found), found[query.offset : query.offset + query.limit])
