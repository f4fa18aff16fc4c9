"""Sessions as operations: open, get, extend, finish, hint, prefetch, close and list the
sessions of the caller's tenant, one implementation under every carrier (REST's
``/v1/sessions``, the data plane's SESSION request on the stream and the same-host socket).

A session is its tenant's: a caller names only its own tenant's sessions, and another tenant's
session of the same id is ``SessionNotFound``, as one that is not open. What a session is
(sliding TTL, chain pins, head, forecast) is ``sessioncache.sessions.manager``'s; a lookup or a
store on behalf of one is ``lookups.py``'s and ``stores.py``'s, but for what a REST store
plan (``stores.plan_upload``) means for its session, which is here: its chain is recorded once
the plan's uploads are answered (``record_plan``, ``uploaded``), as a STORE's is once its
blocks are held, never when the plan is made.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

from sessioncache.attribution import SessionTotals
from sessioncache.errors import SessionNotFound
from sessioncache.hashing import BlockHash
from sessioncache.node import CacheNode
from sessioncache.operations.caller import Caller
from sessioncache.operations.messages import (
    PrefetchResult,
    SessionExtend,
    SessionFinish,
    SessionHint,
    SessionOpen,
    SessionResult,
)
from sessioncache.sessions.hints import parse_hints
from sessioncache.sessions.manager import Session
from sessioncache.status import BlockStatus
from sessioncache.store import Write
from sessioncache.store.uploads import UploadSlot


def open_session(node: CacheNode, caller: Caller, request: SessionOpen) -> SessionResult:
    """Open a session of the caller's tenant, or return its open one of that id
    (``QuotaExceeded`` past the tenant's open sessions; ``InvalidInput`` for an unknown kind,
    a bad id or TTL)."""
    session = node.sessions.open(
        request.session_id,
        tenant=caller.tenant,
        kind=request.kind,
        ttl_s=request.ttl_s,
        parent=request.parent,
    )
    return _result(node, session)


def get_session(node: CacheNode, caller: Caller, session_id: str) -> SessionResult:
    """The caller's open session, with its lookups' totals and its chain's blocks per tier
    (``SessionNotFound`` otherwise)."""
    session = node.sessions.get(session_id, tenant=caller.tenant)
    result = _result(node, session, node.attribution.session_totals(session.key))
    return result._replace(resident=node.prefetch.resident(session.key))


def extend_session(node: CacheNode, caller: Caller, request: SessionExtend) -> SessionResult:
    """Slide the caller's session's expiry (with a new TTL when given)."""
    session = node.sessions.extend(request.session_id, tenant=caller.tenant, ttl_s=request.ttl_s)
    return _result(node, session)


def finish_session(node: CacheNode, caller: Caller, request: SessionFinish) -> SessionResult:
    """The caller's session's latest request finished, for ``finish_reason``: its chain is
    filed under the forecast that follows (``SessionManager.record``)."""
    session = node.sessions.record(
        request.session_id, tenant=caller.tenant, finish_reason=request.finish_reason
    )
    return _result(node, session)


def hint_session(node: CacheNode, caller: Caller, request: SessionHint) -> SessionResult:
    """Take an agent hint, in any of the field's formats (``sessions.hints``), for the
    caller's session (``InvalidInput`` for a malformed one, ``SessionNotFound`` for a session
    not open or another tenant's)."""
    node.sessions.get(request.session_id, tenant=caller.tenant)  # not found before malformed
    hint = parse_hints(request.body, node.sessions.store.clock.now(), request.block_tokens)
    session = node.sessions.hint(request.session_id, hint, tenant=caller.tenant)
    result = _result(node, session)
    if hint.prefetch:
        result = result._replace(prefetch=prefetch_session(node, caller, request.session_id))
    return result


def prefetch_session(node: CacheNode, caller: Caller, session_id: str) -> PrefetchResult:
    """Start moving the caller's session's chain into the first tier (``node.prefetch``): the
    outcome at once, the move after (``SessionNotFound`` for a session not open or another
    tenant's)."""
    session = node.sessions.get(session_id, tenant=caller.tenant)
    outcome = node.prefetch.request(session.key)
    return PrefetchResult(outcome.outcome, outcome.reason, outcome.blocks)


def close_session(node: CacheNode, caller: Caller, session_id: str) -> None:
    """Close the caller's session: its pins go, its blocks age out by TTL."""
    node.sessions.close(session_id, tenant=caller.tenant)


def list_sessions(node: CacheNode, caller: Caller) -> list[SessionResult]:
    """The caller's tenant's open sessions."""
    return [_result(node, s) for s in node.sessions.list_sessions(tenant=caller.tenant)]


def as_json(result: SessionResult) -> dict[str, Any]:
    """The session as every carrier answers it: the REST API's ``SessionOut`` and the data
    plane's SESSION_OK carry these fields (``attribution`` null but for a ``get``)."""
    s = result.session
    return {
        "id": s.id,
        "tenant": s.tenant,
        "kind": s.kind,
        "ttl_s": s.ttl_s,
        "created": s.created,
        "last_seen": s.last_seen,
        "expires_at": s.expires_at,
        "head": s.head.hex() if s.head is not None else None,
        "pinned": s.pinned,
        "expected_back": result.expected_back,
        "last_finish": result.last_finish,
        "attribution": _totals(result.totals) if result.totals is not None else None,
        "hint": result.hint.as_json() if result.hint is not None else None,
        "resident": dict(result.resident) if result.resident is not None else None,
        "prefetch": result.prefetch._asdict() if result.prefetch is not None else None,
    }


def _totals(totals: SessionTotals) -> dict[str, Any]:
    div = totals.last_divergence
    return {
        "lookups": totals.lookups,
        "hit_tokens": totals.hit_tokens,
        "miss_tokens": dict(totals.miss_tokens),
        "last_divergence": {
            "block": div.block,
            "offset": div.offset,
            "token": div.token,
            "at": div.at,
            "lost_blocks": div.lost_blocks,
        }
        if div is not None
        else None,
    }


def _result(
    node: CacheNode, session: Session, totals: SessionTotals | None = None
) -> SessionResult:
    rhythm = node.sessions.forecasts.current(session.key)
    return SessionResult(
        session,
        rhythm[0] if rhythm is not None else None,
        rhythm[1] if rhythm is not None else None,
        totals,
        node.sessions.hints.snapshot(session.key),
    )


# -- a REST store plan's session --------------------------------------------------------------


class _Plan(NamedTuple):
    """What a REST plan records for its session once its uploads are answered."""

    tenant: str
    session_id: str
    hashes: Sequence[BlockHash]
    """Every id of the prompt."""
    wanted: Sequence[int]
    """The prompt's index of each block of the plan's write (those it lacked)."""
    tokens: bytes
    block_tokens: int
    finish_reason: str | None


_plans: weakref.WeakKeyDictionary[Write, _Plan] = weakref.WeakKeyDictionary()
"""The session plans with uploads still unanswered, by their write (gone with its slots)."""
_plans_lock = threading.Lock()


def record_plan(
    node: CacheNode,
    caller: Caller,
    session_id: str,
    hashes: Sequence[BlockHash],
    tokens: bytes,
    block_tokens: int,
    finish_reason: str | None,
    *,
    write: Write | None = None,
    wanted: Sequence[int] = (),
) -> None:
    """A REST store plan of ``hashes`` for a session: with nothing to upload (``write``
    None) its chain is the session's now; else once each of the write's blocks (prompt
    indexes ``wanted``) was uploaded (``uploaded``): the chain up to the first block not held
    then, pinned, its head the last. A plan whose uploads never all come leaves the session as
    it was. ``finish_reason`` takes effect with the record, even when no block is held."""
    plan = _Plan(caller.tenant, session_id, hashes, wanted, tokens, block_tokens, finish_reason)
    if write is None:
        _record(node, plan, len(hashes))
        return
    with _plans_lock:
        _plans[write] = plan


def uploaded(node: CacheNode, slot: UploadSlot) -> None:
    """One upload of a session's plan was answered (its block's status set): the last of the
    plan's records the session's chain; one after that (a retry of a dropped block) pins its
    stored block to the session's chain (``SessionManager.adopt``)."""
    write = slot.write
    with _plans_lock:
        plan = _plans.get(write)
        if plan is not None:
            if any(s is None for s in write.status):
                return  # more uploads to come
            del _plans[write]
    if plan is None:
        if slot.session_id is not None and write.status[slot.index] is BlockStatus.STORED:
            node.sessions.adopt((slot.tenant, slot.session_id), [slot.block_hash])
        return
    held = len(plan.hashes)
    for status, index in zip(write.status, plan.wanted, strict=True):
        if status is None or not status.held:
            held = index
            break
    with contextlib.suppress(SessionNotFound):  # closed or expired since the plan
        _record(node, plan, held)


def _record(node: CacheNode, plan: _Plan, held: int) -> None:
    """The session's chain is the plan's first ``held`` blocks (or, with none held, what it
    was: a finish reason still files it)."""
    key = (plan.tenant, plan.session_id)
    if held:
        chain = plan.hashes[:held]
        node.sessions.record(
            plan.session_id, chain, tenant=plan.tenant, finish_reason=plan.finish_reason
        )
        whole = held == len(plan.hashes)
        tokens = plan.tokens if whole else plan.tokens[: 4 * plan.block_tokens * held]
        node.attribution.stored(key, chain, bytes(tokens))
    elif plan.finish_reason is not None:
        node.sessions.record(plan.session_id, tenant=plan.tenant, finish_reason=plan.finish_reason)
