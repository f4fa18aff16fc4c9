"""SESSION and SESSION_OK frames (sans I/O): a session's open, get, extend, finish and close on
the data plane, as ``/v1/sessions`` does them over REST. Version 3 added them
(``SESSION_VERSION``): both frames carry that version byte, and a connection that negotiated
version 2 carries neither.

SESSION's body is a JSON object ``{"verb", "session_id"?, "kind"?, "ttl_s"?, "parent"?,
"finish_reason"?}``; SESSION_OK's is the session as the REST API answers it (``SessionOut``'s
fields), or ``{}`` for ``close``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

from sessioncache.dataplane.frames.control import _json_body
from sessioncache.dataplane.frames.header import SESSION_VERSION, Op, frame
from sessioncache.errors import InvalidInput

VERBS = ("open", "get", "extend", "finish", "close")
"""What a SESSION does: open a session (or return the caller's open one of that id), read it,
slide its expiry, say its latest request finished, close it."""


class SessionCall(NamedTuple):
    """SESSION: one verb on a session of the caller's tenant. ``session_id`` is required but
    for ``open`` (which then names a new one); ``kind``, ``ttl_s`` and ``parent`` are
    ``open``'s, ``ttl_s`` also ``extend``'s, ``finish_reason`` ``finish``'s (required)."""

    verb: str
    session_id: str | None = None
    kind: str | None = None
    ttl_s: float | None = None
    parent: str | None = None
    finish_reason: str | None = None


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


def encode_session_ok(request_id: int, session: Mapping[str, Any] | None) -> bytes:
    """SESSION_OK: the session as the REST API answers it; None (``close``): ``{}``."""
    return _frame(Op.SESSION_OK, request_id, session or {})


def decode_session_ok(data: bytes) -> dict[str, Any]:
    return _json_body(data, "SESSION_OK")
