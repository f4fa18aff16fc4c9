"""The REST server's connections: at most ``cap`` open at once, and a deadline for each
request head.

uvicorn bounds neither: a connection that sends half a request head and then nothing stays
open for ever (its keep-alive timeout is armed only after a response), and it accepts until
the process runs out of file descriptors, after which the disk tier cannot open a file. So:

- ``cap`` sits below the process's descriptor limit (``connection_cap``), leaving room for the
  tiers, the catalog and the data plane;
- a connection must complete each request head within ``head_timeout_s`` of being opened, or
  of its previous response, else it is closed;
- a connection opened at the cap evicts the oldest one that is waiting for a head (half-open,
  or idle between requests), so that a flood of half-open connections costs a legitimate
  client a reconnect at most; when every connection is busy with a request, the new one is
  answered 503 ``Busy`` and closed.

``guarded_protocol`` makes uvicorn's httptools protocol do this; pass it as ``http=``.
"""

from __future__ import annotations

import json
import resource
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from sessioncache.api.errors import error_body

FD_RESERVE = 128
"""Descriptors kept for everything but REST connections, beside the data plane's."""


def connection_cap(wanted: int, data_plane_connections: int) -> int:
    """``wanted``, lowered to leave ``FD_RESERVE`` and the data plane's connections below
    the soft descriptor limit (at least 16)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(16, min(wanted, soft - FD_RESERVE - data_plane_connections))


class ConnectionGuard:
    """The open connections of one server (event-loop thread only)."""

    def __init__(self, cap: int, head_timeout_s: float) -> None:
        self.cap = cap
        self.head_timeout_s = head_timeout_s
        self.open = 0
        self._waiting: dict[Any, None] = {}  # waiting for a head, oldest first
        self.evicted = 0
        """Connections closed to make room at the cap."""
        self.late = 0
        """Connections closed for a head not complete in time."""
        self.refused = 0
        """Connections answered 503 at the cap, every one busy."""

    def opened(self, conn: Any) -> bool:
        """Count a new connection; False when it must be refused (all others busy)."""
        self.open += 1
        while self.open > self.cap and self._waiting:
            victim = next(iter(self._waiting))
            self.evicted += 1
            self.gone(victim)
            victim.transport.close()
        if self.open > self.cap:
            self.refused += 1
            self.gone(conn)
            return False
        return True

    def waiting(self, conn: Any) -> None:
        self._waiting[conn] = None

    def busy(self, conn: Any) -> None:
        self._waiting.pop(conn, None)

    def gone(self, conn: Any) -> None:
        """A connection closed (or evicted, or refused): counted once."""
        if not getattr(conn, "_guard_gone", False):
            conn._guard_gone = True
            self.open -= 1
        self._waiting.pop(conn, None)


_BUSY = json.dumps(error_body("Busy", "the node serves its maximum of HTTP connections")).encode()
_BUSY_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    + f"content-length: {len(_BUSY)}\r\nconnection: close\r\nretry-after: 1\r\n\r\n".encode()
    + _BUSY
)


def guarded_protocol(guard: ConnectionGuard) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol under ``guard`` (see the module docstring)."""

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _head_timer: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if not guard.opened(self):
                transport.write(_BUSY_ANSWER)
                transport.close()
                return
            self._await_head()

        def _await_head(self) -> None:
            guard.waiting(self)
            self._head_timer = self.loop.call_later(guard.head_timeout_s, self._head_late)

        def _head_late(self) -> None:
            guard.late += 1
            guard.gone(self)
            if not self.transport.is_closing():
                self.transport.close()

        def _head_done(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            guard.busy(self)

        def on_headers_complete(self) -> None:
            self._head_done()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self.pipeline:
                self._await_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_done()
            guard.gone(self)
            super().connection_lost(exc)

    return GuardedHttpToolsProtocol
