"""Sessions: create, get, extend, finish, hint, prefetch, close, list (``/v1/sessions``),
through the session operations (``sessioncache.operations.sessions``) the data plane's SESSION
calls too."""

from __future__ import annotations

from fastapi import APIRouter

from sessioncache.api.deps import NodeDep, TenantDep
from sessioncache.api.paths import SessionIdPath
from sessioncache.api.schemas import (
    ERRORS,
    PrefetchOut,
    SessionCreate,
    SessionExtend,
    SessionFinish,
    SessionList,
    SessionOut,
)
from sessioncache.api.schemas_hints import SessionHints
from sessioncache.operations import messages
from sessioncache.operations import sessions as ops
from sessioncache.operations.caller import Caller
from sessioncache.operations.messages import SessionResult

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])


def session_out(result: SessionResult) -> SessionOut:
    return SessionOut.model_validate(ops.as_json(result))


@router.post("", response_model=SessionOut, status_code=201, responses=ERRORS)
def create_session(body: SessionCreate, node: NodeDep, tenant: TenantDep) -> SessionOut:
    """Open a session (or return the caller's open session with that id)."""
    request = messages.SessionOpen(body.session_id, body.kind, body.ttl_s, body.parent)
    return session_out(ops.open_session(node, Caller(tenant), request))


@router.get("", response_model=SessionList, responses=ERRORS)
def list_sessions(node: NodeDep, tenant: TenantDep) -> SessionList:
    return SessionList(sessions=[session_out(s) for s in ops.list_sessions(node, Caller(tenant))])


@router.get("/{session_id}", response_model=SessionOut, responses=ERRORS)
def get_session(session_id: SessionIdPath, node: NodeDep, tenant: TenantDep) -> SessionOut:
    """The session, with its lookups' tokens hit and missed by reason and the last point
    where its prompt diverged from the one before (``attribution``)."""
    return session_out(ops.get_session(node, Caller(tenant), session_id))  # another's: 404


@router.post("/{session_id}/extend", response_model=SessionOut, responses=ERRORS)
def extend_session(
    session_id: SessionIdPath, body: SessionExtend, node: NodeDep, tenant: TenantDep
) -> SessionOut:
    """Slide the session's expiry (optionally with a new TTL)."""
    request = messages.SessionExtend(session_id, body.ttl_s)
    return session_out(ops.extend_session(node, Caller(tenant), request))


@router.post("/{session_id}/finish", response_model=SessionOut, responses=ERRORS)
def finish_session(
    session_id: SessionIdPath, body: SessionFinish, node: NodeDep, tenant: TenantDep
) -> SessionOut:
    """The session's latest request finished, for ``finish_reason``: its blocks are kept or
    evicted by when the session is predicted back (a store's ``finish_reason`` says the same
    with the store)."""
    request = messages.SessionFinish(session_id, body.finish_reason)
    return session_out(ops.finish_session(node, Caller(tenant), request))


@router.post("/{session_id}/hints", response_model=SessionOut, responses=ERRORS)
def hint_session(
    session_id: SessionIdPath, body: SessionHints, node: NodeDep, tenant: TenantDep
) -> SessionOut:
    """An agent hint in any of the field's formats (``agent_hint``: uni-agent's or vLLM's;
    ``agent_hints``: SGLang's; ``retention_directives``: vLLM's), as engines and routers
    carry them: a soft TTL, a priority, an expected return, a parent, ``final`` (docs/
    sessions.md, "Agent hints"). A malformed hint is a 422 saying what is wrong."""
    fields = body.model_dump(exclude_none=True)
    block_tokens = fields.pop("block_tokens", None)
    request = messages.SessionHint(session_id, fields, block_tokens)
    return session_out(ops.hint_session(node, Caller(tenant), request))


@router.post(
    "/{session_id}/prefetch", response_model=PrefetchOut, status_code=202, responses=ERRORS
)
def prefetch_session(session_id: SessionIdPath, node: NodeDep, tenant: TenantDep) -> PrefetchOut:
    """Start moving the session's chain from disk or the shared tier into the CPU tier, ahead
    of its next request: ``accepted`` (``blocks`` to move; ``resident`` in the session's GET
    shows them arrive), ``deferred`` (retry later) or ``rejected`` (``reason`` says why: the
    tenant's share, no chain, no CPU tier)."""
    outcome = ops.prefetch_session(node, Caller(tenant), session_id)
    return PrefetchOut.model_validate(outcome._asdict())


@router.delete("/{session_id}", status_code=204, responses=ERRORS)
def close_session(session_id: SessionIdPath, node: NodeDep, tenant: TenantDep) -> None:
    """Close the session: its pins go, its blocks age out by TTL."""
    ops.close_session(node, Caller(tenant), session_id)
