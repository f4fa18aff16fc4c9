"""Whether the catalog can be used now. An error of its database that says it is down, locked,
read-only or out of room makes the catalog *unavailable*: the call raises ``CatalogUnavailable``
(answered 503 with ``Retry-After``), ``/readyz`` reports it and the log has one line when it
starts and one when it ends, not one per call. While it lasts, calls fail at once but for one
a second (``RETRY_S``) that tries the database again; the catalog's flusher is one of them, so
the catalog is found back without traffic. Any other database error is raised as it is."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from sqlalchemy import Connection, Engine, false, update
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from sessioncache.catalog.models import sessions_table
from sessioncache.errors import CatalogUnavailable

log = logging.getLogger("sessioncache.catalog")

RETRY_S = 1.0
"""While the catalog is unavailable, how often a call tries it again (the others fail at once)."""

# SQLSTATE classes and codes of a server that cannot take the call now: connection (08),
# insufficient resources (53: disk full, out of memory, too many connections), operator
# intervention (57: shutting down, cannot connect now), read-only transaction (25006),
# no privilege to write (42501)
_UNAVAILABLE_STATES = ("08", "53", "57", "25006", "42501")


def unavailable_reason(exc: BaseException) -> str | None:
    """Why ``exc`` says the catalog cannot be used now (None: another error, a bug)."""
    if isinstance(exc, PoolTimeout):
        return "no catalog connection came free in time"
    if not isinstance(exc, DBAPIError):
        return None
    state = getattr(exc.orig, "sqlstate", None)
    unavailable = (
        isinstance(exc, OperationalError | InterfaceError)
        or exc.connection_invalidated
        or (isinstance(state, str) and state.startswith(_UNAVAILABLE_STATES))
    )
    if not unavailable:
        return None
    message = str(exc.orig).strip().splitlines()
    return message[0] if message else type(exc.orig).__name__


class CatalogHealth:
    """The catalog's state as its calls find it (see the module docstring); ``label`` names
    the catalog in messages (its file, or its URL without a password)."""

    def __init__(self, label: str, *, wait_s: float, retry_s: float = RETRY_S) -> None:
        self.label = label
        self.wait_s = wait_s
        self.retry_s = retry_s
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._since = 0.0
        self._tried = 0.0
        self.failures = 0
        """How many calls found the catalog unavailable (a writer waiting for its turn looks
        whether one did meanwhile)."""

    @property
    def reason(self) -> str | None:
        """What the last call found wrong (None: the catalog is available)."""
        return self._reason

    def problem(self) -> str | None:
        """Why the catalog is unavailable (None: it is not), for ``/readyz``."""
        reason = self._reason
        return None if reason is None else f"catalog {self.label}: {reason}"

    def due(self) -> bool:
        """Whether a call may try the database now."""
        with self._lock:
            return self._reason is None or time.monotonic() - self._tried >= self.retry_s

    def admit(self) -> None:
        """Before a call: raise at once while the catalog is unavailable and another call
        tried it less than ``retry_s`` ago; else this call is the one that tries."""
        with self._lock:
            if self._reason is None:
                return
            now = time.monotonic()
            if now - self._tried < self.retry_s:
                raise self._error(self._reason)
            self._tried = now

    def failed(self, reason: str) -> CatalogUnavailable:
        """A call found the catalog unavailable: the error to raise (logged when it is new)."""
        with self._lock:
            now = time.monotonic()
            self._tried = now
            if self._reason is None:
                self._since = now
                log.warning(
                    "catalog %s unavailable: %s; session calls are answered 503 until it is "
                    "back (blocks are still served and stored)",
                    self.label,
                    reason,
                )
            self._reason = reason
            self.failures += 1
            return self._error(reason)

    def succeeded(self) -> None:
        """A call wrote to the catalog: it is available (logged when it was not). A read
        that succeeds says nothing of writes (SQLite serves reads while another process
        holds its write lock)."""
        if self._reason is None:
            return
        with self._lock:
            if self._reason is None:
                return
            self._reason = None
            log.warning(
                "catalog %s available again after %.1f s",
                self.label,
                time.monotonic() - self._since,
            )

    def busy(self) -> CatalogUnavailable:
        """The error of a call that waited longer than ``wait_s`` for the catalog's one writer
        (the catalog may be well: its state is not changed)."""
        return self._error(f"a write waited more than {self.wait_s:g} s for the catalog")

    def _error(self, reason: str) -> CatalogUnavailable:
        exc = CatalogUnavailable(f"the catalog is unavailable ({reason}); retry later")
        exc.retry_after = self.retry_s
        return exc

    def refusal(self) -> CatalogUnavailable:
        """The error of a call refused because the catalog is unavailable."""
        return self._error(self._reason or "unavailable")

    @contextmanager
    def answering(self, *, write: bool = False) -> Iterator[None]:
        """Around a use of the database: its errors that say the catalog is unavailable are
        raised as ``CatalogUnavailable`` (see the module docstring); a ``write`` that
        succeeds makes it available. Within another on the same thread it only notes a
        write: the outer one answers for both."""
        if getattr(_inside, "call", False):
            _inside.wrote = _inside.wrote or write
            yield
            return
        self.admit()
        _inside.call, _inside.wrote = True, write
        try:
            yield
        except SQLAlchemyError as exc:
            reason = unavailable_reason(exc)
            if reason is None:
                raise
            raise self.failed(reason) from None
        finally:
            _inside.call = False
        if _inside.wrote:
            self.succeeded()


_inside = threading.local()


class CatalogWriter:
    """The catalog's one writer: a transaction at a time (batches in order), and a call waits
    at most the catalog's ``wait_s`` for its turn."""

    def __init__(self, engine: Engine, health: CatalogHealth) -> None:
        self._engine = engine
        self._health = health
        self._lock = threading.Lock()

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the writer (``CatalogUnavailable`` after ``wait_s``, or at once when the
        writer before found the catalog unavailable meanwhile: the wait is ``wait_s`` in all,
        not one per writer queued)."""
        health = self._health
        failures = health.failures
        if not self._lock.acquire(timeout=health.wait_s):
            raise health.busy()
        if health.failures != failures:
            self._lock.release()
            raise health.refusal()
        try:
            yield
        finally:
            self._lock.release()

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A transaction of the writer, committed on exit; its errors answered."""
        with self._health.answering(write=True), self.turn(), self._engine.begin() as conn:
            yield conn

    def probe(self) -> None:
        """Whether the catalog takes writes now (``write_nothing``)."""
        with self._health.answering(write=True), self.turn():
            write_nothing(self._engine)


def write_nothing(engine: Engine) -> None:
    """A write that changes nothing, rolled back: it still takes SQLite's write lock, and
    PostgreSQL checks that it may write (raises the database's error when it cannot)."""
    t = sessions_table
    with engine.connect() as conn:
        conn.execute(update(t).where(false()).values(ttl_s=t.c.ttl_s))
        conn.rollback()


class Guarded(Protocol):
    """What ``answered`` needs of the object whose method it wraps."""

    @property
    def health(self) -> CatalogHealth: ...


_S = TypeVar("_S", bound=Guarded)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def answered(call: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """A catalog method whose uses of the database are answered by its ``health``
    (``CatalogHealth.answering``)."""

    @functools.wraps(call)
    def guarded(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self.health.answering():
            return call(self, *args, **kwargs)

    return guarded
