"""The operation layer's calls that data-plane frames name, for both of the node's servers
(``server``, ``samehost_server``): a STORE's or STAGE's ``StoreRequest``, a LOOKUP's or
LOCATE's ``LookupRequest``, and the session operation a SESSION names."""

from __future__ import annotations

from sessioncache.dataplane import frames
from sessioncache.dataplane.frames import StoreHead
from sessioncache.errors import InvalidInput
from sessioncache.hashing import BlockHash
from sessioncache.node import CacheNode
from sessioncache.operations import sessions
from sessioncache.operations.caller import Caller
from sessioncache.operations.messages import (
    LookupRequest,
    PrefetchResult,
    SessionExtend,
    SessionFinish,
    SessionHint,
    SessionOpen,
    SessionResult,
    StoreRequest,
)


def store_request(head: StoreHead, units: bytes) -> StoreRequest:
    """The operation layer's request for a STORE's or STAGE's head and token section."""
    return StoreRequest(
        head.root,
        head.parent,
        head.block_tokens,
        head.blocks,
        head.block_nbytes,
        units,
        head.ttl_ms / 1000 if head.ttl_ms else None,
        head.keyed,
        head.linked,
        head.session_id,
        head.durable,
        head.finish_reason,
    )


def lookup_request(request: frames.Lookup) -> LookupRequest:
    return LookupRequest(
        request.root,
        [BlockHash(h) for h in request.ids],
        lease_s=request.lease_ms / 1000 if request.lease_ms else None,
        session_id=request.session_id,
        keyed=request.keyed,
        counted=request.counted,
        declined=request.declined,
    )


def session_call(
    node: CacheNode, caller: Caller, call: frames.SessionCall
) -> SessionResult | PrefetchResult | None:
    """The session operation a SESSION names (``frames.VERBS``); None for a ``close``."""
    sid = call.session_id
    if call.verb == "open":
        kind = {"kind": call.kind} if call.kind is not None else {}
        return sessions.open_session(
            node, caller, SessionOpen(sid, ttl_s=call.ttl_s, parent=call.parent, **kind)
        )
    if sid is None:
        raise InvalidInput(f"SESSION {call.verb}: a session_id is required")
    if call.verb == "get":
        return sessions.get_session(node, caller, sid)
    if call.verb == "extend":
        return sessions.extend_session(node, caller, SessionExtend(sid, call.ttl_s))
    if call.verb == "finish":
        if call.finish_reason is None:
            raise InvalidInput("SESSION finish: a finish_reason is required")
        return sessions.finish_session(node, caller, SessionFinish(sid, call.finish_reason))
    if call.verb == "hint":
        if call.hint is None:
            raise InvalidInput("SESSION hint: a hint is required")
        return sessions.hint_session(node, caller, SessionHint(sid, call.hint, call.block_tokens))
    if call.verb == "prefetch":
        return sessions.prefetch_session(node, caller, sid)
    if call.verb != "close":
        raise InvalidInput(f"SESSION: unknown verb {call.verb!r}")
    sessions.close_session(node, caller, sid)
    return None
