"""SESSION and SESSION_OK frames (sans I/O): a session's open, get, extend, finish, hint,
prefetch and close on the data plane, as ``/v1/sessions`` does them over REST. Version 3 added
them (``SESSION_VERSION``): both frames carry that version byte, and a connection that
negotiated version 2 carries neither.

SESSION's body is a JSON object ``{"verb", "session_id"?, "kind"?, "ttl_s"?, "parent"?,
"finish_reason"?, "hint"?, "block_tokens"?}``; SESSION_OK's is the session as the REST API
answers it (``SessionOut``'s fields), the prefetch's outcome for ``prefetch`` (``{"outcome",
"reason", "blocks"}``), or ``{}`` for ``close``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

from sessioncache.dataplane.frames.control import _json_body
from sessioncache.dataplane.frames.header import SESSION_VERSION, Op, frame
from sessioncache.errors import InvalidInput

VERBS = ("open", "get", "extend", "finish", "close", "hint", "prefetch")
"""What a SESSION does: open a session (or return the caller's open one of that id), read it,
slide its expiry, say its latest request finished, close it, give it an agent hint (``hint``:
a body of ``POST /v1/sessions/{id}/hints``), start moving its chain into the first tier."""


class SessionCall(NamedTuple):
    """SESSION: one verb on a session of the caller's tenant. ``session_id`` is required but
    for ``open`` (which then names a new one); ``kind``, ``ttl_s`` and ``parent`` are
    ``open``'s, ``ttl_s`` also ``extend``'s, ``finish_reason`` ``finish``'s (required),
    ``hint`` (required) and ``block_tokens`` ``hint``'s."""

    verb: str
    session_id: str | None = None
    kind: str | None = None
    ttl_s: float | None = None
    parent: str | None = None
    finish_reason: str | None = None
    hint: dict[str, Any] | None = None
    block_tokens: int | None = None


_TEXT = ("session_id", "kind", "parent", "finish_reason")


def _frame(opcode: Op, request_id: int, body: Mapping[str, Any]) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    return frame(opcode, request_id, data, version=SESSION_VERSION)


def encode_session_call(request_id: int, call: SessionCall) -> bytes:
    check_session_call(call)
    return _frame(
        Op.SESSION, request_id, {k: v for k, v in call._asdict().items() if v is not None}
    )


def decode_session_call(data: bytes) -> SessionCall:
    """A SESSION's call; ``FrameError`` for a body that is not a JSON object, ``InvalidInput``
    for an unknown field, verb or a field of the wrong type."""
    body = _json_body(data, "SESSION")
    unknown = set(body) - set(SessionCall._fields)
    if unknown:
        raise InvalidInput(f"SESSION: unknown fields {sorted(unknown)}")
    ttl_s = body.get("ttl_s")
    if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float)):
        raise InvalidInput("SESSION: ttl_s must be a number")
    for name in _TEXT:
        if not isinstance(body.get(name), str | None):
            raise InvalidInput(f"SESSION: {name} must be a string")
    if not isinstance(body.get("hint"), dict | None):
        raise InvalidInput("SESSION: hint must be an object")
    block_tokens = body.get("block_tokens")
    if block_tokens is not None and (
        isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1
    ):
        raise InvalidInput("SESSION: block_tokens must be a positive integer")
    call = SessionCall(**body)
    check_session_call(call)
    return call


def check_session_call(call: SessionCall) -> None:
    """A call's verb and the fields it needs (``InvalidInput``); values are the operation's to
    check, as over REST."""
    if call.verb not in VERBS:
        raise InvalidInput(f"SESSION: unknown verb {call.verb!r}; verbs are {list(VERBS)}")
    if call.verb != "open" and call.session_id is None:
        raise InvalidInput(f"SESSION {call.verb}: a session_id is required")
    if call.verb == "finish" and call.finish_reason is None:
        raise InvalidInput("SESSION finish: a finish_reason is required")
    if call.verb == "hint" and call.hint is None:
        raise InvalidInput("SESSION hint: a hint is required")


def encode_session_ok(request_id: int, session: Mapping[str, Any] | None) -> bytes:
    """SESSION_OK: the session as the REST API answers it (or a prefetch's outcome); None
    (``close``): ``{}``."""
    return _frame(Op.SESSION_OK, request_id, session or {})


def decode_session_ok(data: bytes) -> dict[str, Any]:
    return _json_body(data, "SESSION_OK")
