"""The REST server's connections: at most ``cap`` open at once, no tenant holding more than
its share of them, and a deadline on each request head and body.

uvicorn bounds none of this: a connection that sends half a request head, or a head and then
no body, stays open for ever (its keep-alive timeout is armed only after a response), and it
accepts until the process runs out of file descriptors, after which the disk tier cannot open
a file. So:

- ``cap`` sits below the process's descriptor limit (``connection_cap``), leaving room for the
  tiers, the catalog and the data plane;
- a connection must complete each request head within ``Deadlines.head_s`` of being opened,
  or of its previous response, else it is closed: an idle keep-alive connection is closed by
  then even if it trickles bytes (uvicorn's keep-alive timeout closes a silent one sooner);
- a request body must keep arriving at a least rate after a grace from its head
  (``Deadlines.body_due_s``), else it is answered 408 ``RequestTimeout`` (just closed if its
  answer has started): a stalled body is closed within the grace, however long it claims to
  be;
- a connection opened at the cap evicts the one stalled longest, that is, received nothing
  for the longest while waiting for a head (half-open, or idle between requests) or a body;
  a flood of stalled connections costs a legitimate client a reconnect at most. When every
  connection is busy with a request, the new one is answered 503 ``Busy`` and closed;
- with API keys, a connection counts as its tenant's from its first request head (the
  ``Authorization: Bearer`` key's; ``ANONYMOUS`` without a known key) in the
  ``http_connections`` tally of ``quotas``; a request past the tenant's bound is answered
  429 ``QuotaExceeded`` and its connection closed.

``guarded_protocol`` makes uvicorn's httptools protocol do this; pass it as ``http=``.
"""

from __future__ import annotations

import json
import resource
from asyncio import TimerHandle
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from sessioncache.api.errors import error_body
from sessioncache.errors import Busy, QuotaExceeded, RequestTimeout
from sessioncache.quotas import Tally

FD_RESERVE = 128
"""Descriptors kept for everything but REST connections, beside the data plane's."""

ANONYMOUS = "(anonymous)"
"""The tenant that connections without a known API key count as, together."""

Headers = list[tuple[bytes, bytes]]


def connection_cap(wanted: int, data_plane_connections: int) -> int:
    """``wanted``, lowered to leave ``FD_RESERVE`` and the data plane's connections below
    the soft descriptor limit (at least 16)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(16, min(wanted, soft - FD_RESERVE - data_plane_connections))


class Deadlines(NamedTuple):
    """How long a connection may take to send a request head, and a body."""

    head_s: float
    body_floor_s: float
    body_bytes_per_s: float

    def body_due_s(self, received: int) -> float:
        """How long after its head a body that has ``received`` bytes may take for its next:
        the grace ``body_floor_s``, plus the time those bytes earned at the least rate (a body
        of ``n`` bytes is due whole within ``body_floor_s + n / body_bytes_per_s``)."""
        return self.body_floor_s + received / self.body_bytes_per_s


class TenantConnections(NamedTuple):
    """Whose connection each is: ``tenant_for_key`` names a bearer key's tenant (None: no
    tenant's), and ``tally`` counts each tenant's connections against its bound."""

    tenant_for_key: Callable[[str | None], str | None]
    tally: Tally


class ConnectionGuard:
    """The open connections of one server (event-loop thread only)."""

    def __init__(
        self, cap: int, deadlines: Deadlines, tenants: TenantConnections | None = None
    ) -> None:
        self.cap = cap
        self.deadlines = deadlines
        self.tenants = tenants
        self._open: set[Any] = set()
        self._stalled: dict[Any, None] = {}  # waiting for a head or a body, stalled longest first
        self._tenant: dict[Any, str] = {}
        self.evicted = 0
        """Connections closed to make room at the cap."""
        self.late = 0
        """Connections closed for a head or a body not complete in time."""
        self.refused = 0
        """Connections answered 503 at the cap, every one busy."""

    @property
    def open(self) -> int:
        return len(self._open)

    def opened(self, conn: Any) -> bool:
        """Count a new connection; False when it must be refused (all others busy)."""
        self._open.add(conn)
        while len(self._open) > self.cap and self._stalled:
            victim = next(iter(self._stalled))
            self.evicted += 1
            victim.drop(
                f"stalled longest at the node's cap of {self.cap} connections "
                "(http_max_connections): closed to make room"
            )
        if len(self._open) > self.cap:
            self.refused += 1
            self.gone(conn)
            return False
        return True

    def claim(self, conn: Any, key: str | None) -> QuotaExceeded | None:
        """Count ``conn`` as the tenant of a request's bearer ``key``; the refusal, with the
        connection no tenant's, when that tenant already holds its bound of them."""
        if self.tenants is None:
            return None
        tenant = self.tenants.tenant_for_key(key) or ANONYMOUS
        if self._tenant.get(conn) == tenant:
            return None
        self._release(conn)
        try:
            self.tenants.tally.admit(tenant)
        except QuotaExceeded as exc:
            return exc
        self._tenant[conn] = tenant
        return None

    def waiting(self, conn: Any) -> None:
        """``conn`` waits for bytes of a head or a body: it may stall."""
        self._stalled[conn] = None

    def progress(self, conn: Any) -> None:
        """``conn`` received bytes: stalled the least, if it waits."""
        if conn in self._stalled:
            del self._stalled[conn]
            self._stalled[conn] = None

    def busy(self, conn: Any) -> None:
        """``conn`` waits on the node, not on its client."""
        self._stalled.pop(conn, None)

    def gone(self, conn: Any) -> None:
        """A connection closed (or evicted, or refused): counted once."""
        self._open.discard(conn)
        self._stalled.pop(conn, None)
        self._release(conn)

    def _release(self, conn: Any) -> None:
        tenant = self._tenant.pop(conn, None)
        if tenant is not None and self.tenants is not None:
            self.tenants.tally.release(tenant)


def bearer_key(headers: Headers) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, None without one."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, key = value.decode("latin-1").partition(" ")
            return key.strip() or None if scheme.lower() == "bearer" else None
    return None


def has_body(headers: Headers) -> bool:
    """Whether a request's head announces a body."""
    return any(
        name == b"transfer-encoding" or (name == b"content-length" and value != b"0")
        for name, value in headers
    )


def answer(status: str, error: str, detail: str, *extra: str) -> bytes:
    """A whole HTTP answer with an error body, closing its connection."""
    body = json.dumps(error_body(error, detail)).encode()
    head = [f"HTTP/1.1 {status}", "content-type: application/json"]
    head += [f"content-length: {len(body)}", "connection: close", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


_BUSY_ANSWER = answer(
    "503 Service Unavailable",
    Busy.__name__,
    "the node serves its maximum of HTTP connections",
    "retry-after: 1",
)


def refusal(exc: QuotaExceeded) -> Callable[[Scope, Receive, Send], Any]:
    """An ASGI app answering every request 429 with ``exc``, closing the connection."""
    body = json.dumps(error_body(type(exc).__name__, str(exc))).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        (b"retry-after", b"1"),
    ]

    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 429, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return refuse


def guarded_protocol(guard: ConnectionGuard) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol under ``guard`` (see the module docstring)."""
    deadlines = guard.deadlines

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _awaiting: Literal["head", "body"] | None = None
        _deadline: TimerHandle | None = None
        _body_from = 0.0  # when the body, from its _body_base-th byte on, began to be awaited
        _body_base = 0
        _body_got = 0

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if not guard.opened(self):
                transport.write(_BUSY_ANSWER)
                transport.close()
                return
            self._await_head()

        def data_received(self, data: bytes) -> None:
            guard.progress(self)
            super().data_received(data)

        def drop(self, detail: str) -> None:
            """Close this connection, answering 408 with ``detail`` first when it awaits a
            request body whose answer has not started."""
            self._settle()
            guard.gone(self)
            cycle = self.cycle
            if self._awaiting == "body" and not cycle.response_started:
                cycle.disconnected = True  # what the app answers now goes nowhere
                cycle.message_event.set()
                self.transport.write(answer("408 Request Timeout", RequestTimeout.__name__, detail))
            if not self.transport.is_closing():
                self.transport.close()

        def _arm(self, after_s: float, late: Callable[[], None]) -> None:
            self._settle()
            self._deadline = self.loop.call_later(after_s, late)

        def _settle(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _await_head(self) -> None:
            self._awaiting = "head"
            guard.waiting(self)
            self._arm(deadlines.head_s, self._head_late)

        def _head_late(self) -> None:
            guard.late += 1
            self.drop(f"no whole request head within {deadlines.head_s:g} s")

        def _await_body(self) -> None:
            self._awaiting = "body"
            guard.waiting(self)
            self._body_from = self.loop.time()
            self._body_base = self._body_got = 0
            self._arm(deadlines.body_floor_s, self._body_late)

        def _body_late(self) -> None:
            now = self.loop.time()
            if self.flow.read_paused:  # the node holds the body back, not the client:
                self._body_from, self._body_base = now, self._body_got  # a grace anew
            due = self._body_from + deadlines.body_due_s(self._body_got - self._body_base)
            if now < due:
                self._arm(due - now, self._body_late)
                return
            guard.late += 1
            self.drop(
                f"the request body arrived slower than {deadlines.body_bytes_per_s:g} "
                f"bytes/s (http_body_min_bytes_per_s) after {deadlines.body_floor_s:g} s of "
                "grace (http_body_floor_s)"
            )

        def _busy(self) -> None:
            self._awaiting = None
            self._settle()
            guard.busy(self)

        def on_headers_complete(self) -> None:
            self._busy()
            refused = guard.claim(self, bearer_key(self.headers))
            if refused is not None:
                app, self.app = self.app, refusal(refused)
                try:
                    super().on_headers_complete()
                finally:
                    self.app = app
                return
            super().on_headers_complete()
            if has_body(self.headers):
                self._await_body()

        def on_body(self, body: bytes) -> None:
            self._body_got += len(body)
            super().on_body(body)

        def on_message_complete(self) -> None:
            if self._awaiting == "body":
                self._busy()
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self.pipeline:
                self._await_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._settle()
            guard.gone(self)
            super().connection_lost(exc)

    return GuardedHttpToolsProtocol
