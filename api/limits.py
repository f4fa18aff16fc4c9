"""Bounds on what one request may make the node hold: its body (``max_body_bytes``) and its
header block (``MAX_HEADER_BYTES``).

The block upload route reads its body itself, into a pooled buffer, and checks the same limit
(``routes/blocks.read_body``); every other route lets FastAPI read the whole body into memory
before validating it, so without this an unauthenticated client could make the node buffer
any number of bytes per request. uvicorn's httptools parser sets no limit on the header block
(h11's would, at a cost in speed): it is refused here, 431, before any route sees it. The
parser has buffered it by then; a proxy in front bounds that too (docs/security.md).
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sessioncache.api.errors import error_body

MAX_HEADER_BYTES = 64 << 10
"""The largest header block (names and values) a request may carry: an API key and a few
ordinary headers are well under 1 KiB."""


class BodyLimitMiddleware:
    """A 413 for a declared ``Content-Length`` over ``limit`` (before reading a byte of it),
    and for a streamed body growing past it (the app then sees the body end early)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self._app = app
        self._limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        limit = self._limit
        header_bytes = sum(len(n) + len(v) for n, v in scope["headers"])
        if header_bytes > MAX_HEADER_BYTES:
            await _reply(
                send,
                431,
                "HeadersTooLarge",
                f"{header_bytes} bytes of headers exceed the limit of {MAX_HEADER_BYTES}",
            )
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _reply(send, 400, "InvalidInput", "Content-Length is not a number")
                    return
                if declared > limit:
                    await _reply(
                        send,
                        413,
                        "BodyTooLarge",
                        f"body of {declared} bytes exceeds the limit of {limit}",
                    )
                    return
        received = 0
        started = False
        too_large = False

        async def counted_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    too_large = True
                    # end the body here: the app fails on what it got, and we answer 413
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if too_large:
                if not started:
                    started = True
                    await _reply(send, 413, "BodyTooLarge", f"body exceeds the limit of {limit}")
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self._app(scope, counted_receive, tracked_send)


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
