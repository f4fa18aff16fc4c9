"""What every request's head must pass before any route reads its body (``RequestGuard``).

- Its header block is at most ``MAX_HEADER_BYTES`` (431): uvicorn's httptools parser sets no
  limit (h11's would, at a cost in speed). The parser has buffered it by then; a proxy in front
  bounds that too (docs/security.md).
- In open mode (no API keys, loopback only) its ``Host``, when sent, names this host's
  loopback (or its bind address) and an ``Origin``, when sent, does too (403): a page of
  another site that rebinds its DNS name to 127.0.0.1 reaches the node with its own name in
  both.
- With API keys, a request with a body under ``/v1/`` carries a key the node knows (a tenant's
  or the admin token) before a byte of the body is read (401): an unauthenticated client
  makes the node read nothing.
- Its body is at most the route's limit (413), declared or streamed: ``max_body_bytes`` for a
  block upload (``PUT /v1/blocks/{id}``, which reads its body itself, see
  ``routes/blocks.read_body``), ``MAX_LOGIN_BYTES`` for the public admin login,
  ``max_json_bytes`` for every other route, whose body FastAPI reads whole before validating
  it.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sessioncache.api.errors import error_body
from sessioncache.dataplane.transport import is_loopback

MAX_HEADER_BYTES = 64 << 10
"""The largest header block (names and values) a request may carry: an API key and a few
ordinary headers are well under 1 KiB."""

BLOCK_UPLOAD_PREFIX = "/v1/blocks/"

LOGIN_PATH = "/admin/api/login"
MAX_LOGIN_BYTES = 8 << 10
"""The largest body of ``LOGIN_PATH``, which anyone may call: the longest token it takes (4096
characters, ``routes/admin.LoginIn``) with room for JSON's quoting."""


def host_name(value: str) -> str:
    """The host of a ``Host`` header value or an origin's authority: no port, no brackets."""
    if value.startswith("["):
        return value[1:].partition("]")[0]
    return value.rpartition(":")[0] if value.count(":") == 1 else value


class RequestGuard:
    """An ASGI middleware checking each request's head (see the module docstring).

    ``knows_key`` is None in open mode; with API keys it says whether a bearer key is a
    tenant's. ``admin_token`` opens ``/v1`` admin routes too. ``hosts`` are names besides
    loopback that an open node is reached by (its bind address)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        body_limit: int,
        json_limit: int,
        knows_key: Callable[[str], bool] | None,
        admin_token: str | None = None,
        hosts: frozenset[str] = frozenset(),
    ) -> None:
        self._app = app
        self._body_limit = body_limit
        self._json_limit = json_limit
        self._knows_key = knows_key
        self._admin = admin_token.encode() if admin_token else None
        self._hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        headers: dict[bytes, bytes] = {}
        header_bytes = 0
        for name, value in scope["headers"]:
            header_bytes += len(name) + len(value)
            headers.setdefault(name, value)
        if header_bytes > MAX_HEADER_BYTES:
            detail = f"{header_bytes} bytes of headers exceed the limit of {MAX_HEADER_BYTES}"
            await _reply(send, 431, "HeadersTooLarge", detail)
            return
        refused = self._refusal(scope, headers)
        if refused is not None:
            await _reply(send, *refused)
            return
        path: str = scope["path"]
        upload = scope["method"] == "PUT" and path.startswith(BLOCK_UPLOAD_PREFIX)
        limit = self._body_limit if upload else min(self._json_limit, self._body_limit)
        if path == LOGIN_PATH:
            limit = min(limit, MAX_LOGIN_BYTES)
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _reply(send, 400, "InvalidInput", "Content-Length is not a number")
                return
            if size > limit:
                detail = f"body of {size} bytes exceeds the limit of {limit} for {path}"
                await _reply(send, 413, "BodyTooLarge", detail)
                return
        tracked = _Tracked(send, limit)
        await self._app(scope, _counted(receive, tracked), tracked)

    def _refusal(self, scope: Scope, headers: dict[bytes, bytes]) -> tuple[int, str, str] | None:
        """Why the head is refused (status, error, detail), or None."""
        if self._knows_key is None:
            host = host_name(headers.get(b"host", b"").decode("latin-1"))
            if host and not self._local(host):  # a browser always sends one
                return 403, "HostRefused", f"Host {host!r} is not this node's (it runs open)"
            origin = headers.get(b"origin")
            if origin is not None:
                name = urlsplit(origin.decode("latin-1")).hostname or ""
                if not self._local(name):
                    return 403, "HostRefused", "cross-origin requests are refused in open mode"
            return None
        has_body = headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers
        if has_body and scope["path"].startswith("/v1/") and not self._key_known(headers):
            return 401, "AuthRefused", "a valid API key is required: Authorization: Bearer <key>"
        return None

    def _local(self, host: str) -> bool:
        return is_loopback(host) or host in self._hosts

    def _key_known(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, value = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        key = value.strip()
        if scheme.lower() != "bearer" or not key:
            return False
        assert self._knows_key is not None
        if self._knows_key(key):
            return True
        return self._admin is not None and hmac.compare_digest(key.encode(), self._admin)


class _Tracked:
    """``send``, answering 413 instead of the app's answer once the body ran past the limit."""

    def __init__(self, send: Send, limit: int) -> None:
        self.send = send
        self.limit = limit
        self.started = False
        self.too_large = False

    async def __call__(self, message: Message) -> None:
        if self.too_large:
            if not self.started:
                self.started = True
                await _reply(
                    self.send, 413, "BodyTooLarge", f"body exceeds the limit of {self.limit}"
                )
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self.send(message)


def _counted(receive: Receive, tracked: _Tracked) -> Receive:
    """``receive``, ending the body early once it runs past ``tracked.limit``."""
    received = 0

    async def counted_receive() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > tracked.limit:
                tracked.too_large = True
                # end the body here: the app fails on what it got, and 413 is answered
                return {"type": "http.request", "body": b"", "more_body": False}
        return message

    return counted_receive


async def _reply(send: Send, status: int, error: str, detail: str) -> None:
    body = json.dumps(error_body(error, detail)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
