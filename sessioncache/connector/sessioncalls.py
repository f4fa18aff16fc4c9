"""Sessions over the data plane: ``StreamClient`` and ``SameHostClient`` open, read, extend,
finish, hint, prefetch and close sessions with SESSION requests on their own connection, no
REST call. Each answers what the REST client's method of the same name answers
(``results.Session``; ``results.Prefetch`` for ``prefetch_session``; None for
``close_session``) and raises the same errors (``SessionNotFound`` for a session that is not
open or is another tenant's).

SESSION came with data-plane version 3: on a connection to a node that negotiated an older
version the methods raise ``ProtocolError`` before sending anything (docs/dataplane.md,
"Versions").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

from sessioncache.connector import protocol
from sessioncache.connector.results import Prefetch, Session
from sessioncache.dataplane import frames
from sessioncache.dataplane.frames import Op, SessionCall
from sessioncache.errors import ProtocolError


class _Connection(Protocol):
    def call(
        self, op: Op, encode: Callable[[int], bytes], *, payloads: Sequence[memoryview] = ...
    ) -> bytes: ...


C = TypeVar("C", bound=_Connection)


class SessionCalls(Generic[C]):
    """The session methods of a data-plane client over its connection ``_c`` and the version
    it negotiated."""

    _c: C
    version: int
    """The data-plane version the connection negotiated in HELLO."""

    def open_session(
        self,
        session_id: str | None = None,
        *,
        kind: str | None = None,
        ttl_s: float | None = None,
        parent: str | None = None,
    ) -> Session:
        """Open a session (or get the caller's open session with that id); ``kind`` names its
        default TTL (the node's default kind without it). ``parent``: the caller's session it
        was forked from (a subagent's): its close spares their prefix."""
        return self._session(SessionCall("open", session_id, kind, ttl_s, parent))

    def get_session(self, session_id: str) -> Session:
        """The caller's open session, with its lookups' totals (``attribution``)."""
        return self._session(SessionCall("get", session_id))

    def extend_session(self, session_id: str, ttl_s: float | None = None) -> Session:
        """Slide the session's expiry (optionally with a new TTL)."""
        return self._session(SessionCall("extend", session_id, ttl_s=ttl_s))

    def finish_session(self, session_id: str, finish_reason: str) -> Session:
        """The session's latest request finished, for ``finish_reason`` (``tool_use``: the
        agent is expected back in seconds; ``end_turn``, ``stop``: later)."""
        return self._session(SessionCall("finish", session_id, finish_reason=finish_reason))

    def hint_session(
        self, session_id: str, hint: Mapping[str, Any], *, block_tokens: int | None = None
    ) -> Session:
        """An agent hint for the session, in any of the field's formats: ``hint`` holds
        ``agent_hint`` (uni-agent's or vLLM's), ``agent_hints`` (SGLang's) or
        ``retention_directives`` (vLLM's), as an engine's ``kv_transfer_params`` or
        ``extra_args`` do; ``block_tokens``: the engine's tokens per block (maps token
        positions onto blocks). ``InvalidInput`` for a malformed hint."""
        call = SessionCall("hint", session_id, hint=dict(hint), block_tokens=block_tokens)
        return self._session(call)

    def prefetch_session(self, session_id: str) -> Prefetch:
        """Start moving the session's chain into the node's CPU tier ahead of its next
        request (``accepted``, ``deferred`` or ``rejected``, and why)."""
        reply = protocol.Reply(200, {}, self._call(SessionCall("prefetch", session_id)))
        return protocol.parse_prefetch(reply)

    def close_session(self, session_id: str) -> None:
        """Close the session: its pins go, its blocks age out by TTL."""
        self._call(SessionCall("close", session_id))

    def _session(self, call: SessionCall) -> Session:
        return protocol.parse_session(protocol.Reply(200, {}, self._call(call)))

    def _call(self, call: SessionCall) -> bytes:
        if self.version < frames.SESSION_VERSION:
            raise ProtocolError(
                f"the node speaks data-plane version {self.version}; session requests need "
                f"version {frames.SESSION_VERSION}, a later release of the node: upgrade it, or "
                "use its REST API (/v1/sessions)"
            )
        return self._c.call(Op.SESSION, lambda rid: frames.encode_session_call(rid, call))
