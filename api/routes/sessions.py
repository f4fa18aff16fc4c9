"""Sessions: create, get, extend, finish, close, list (``/v1/sessions``)."""

from __future__ import annotations

from fastapi import APIRouter

from sessioncache.api.deps import AttributionDep, SessionsDep, TenantDep
from sessioncache.api.paths import SessionIdPath
from sessioncache.api.schemas import (
    ERRORS,
    DivergenceOut,
    MissTokensOut,
    SessionAttributionOut,
    SessionCreate,
    SessionExtend,
    SessionFinish,
    SessionList,
    SessionOut,
)
from sessioncache.attribution import SessionTotals
from sessioncache.sessions.forecasts import SessionForecasts
from sessioncache.sessions.manager import Session

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])


def session_out(
    session: Session,
    totals: SessionTotals | None = None,
    forecasts: SessionForecasts | None = None,
) -> SessionOut:
    """``forecasts``: the node's, for the session's forecast (``expected_back``)."""
    rhythm = forecasts.current(session.key) if forecasts is not None else None
    return SessionOut(
        id=session.id,
        tenant=session.tenant,
        kind=session.kind,
        ttl_s=session.ttl_s,
        created=session.created,
        last_seen=session.last_seen,
        expires_at=session.expires_at,
        head=session.head.hex() if session.head is not None else None,
        pinned=session.pinned,
        expected_back=rhythm[0] if rhythm is not None else None,
        last_finish=rhythm[1] if rhythm is not None else None,
        attribution=attribution_out(totals) if totals is not None else None,
    )


def attribution_out(totals: SessionTotals) -> SessionAttributionOut:
    div = totals.last_divergence
    return SessionAttributionOut(
        lookups=totals.lookups,
        hit_tokens=totals.hit_tokens,
        miss_tokens=MissTokensOut(**totals.miss_tokens),
        last_divergence=DivergenceOut(
            block=div.block,
            offset=div.offset,
            token=div.token,
            at=div.at,
            lost_blocks=div.lost_blocks,
        )
        if div is not None
        else None,
    )


@router.post("", response_model=SessionOut, status_code=201, responses=ERRORS)
def create_session(body: SessionCreate, sessions: SessionsDep, tenant: TenantDep) -> SessionOut:
    """Open a session (or return the caller's open session with that id)."""
    session = sessions.open(
        body.session_id, tenant=tenant, kind=body.kind, ttl_s=body.ttl_s, parent=body.parent
    )
    return session_out(session, forecasts=sessions.forecasts)


@router.get("", response_model=SessionList, responses=ERRORS)
def list_sessions(sessions: SessionsDep, tenant: TenantDep) -> SessionList:
    return SessionList(
        sessions=[
            session_out(s, forecasts=sessions.forecasts)
            for s in sessions.list_sessions(tenant=tenant)
        ]
    )


@router.get("/{session_id}", response_model=SessionOut, responses=ERRORS)
def get_session(
    session_id: SessionIdPath, sessions: SessionsDep, attribution: AttributionDep, tenant: TenantDep
) -> SessionOut:
    """The session, with its lookups' tokens hit and missed by reason and the last point
    where its prompt diverged from the one before (``attribution``)."""
    session = sessions.get(session_id, tenant=tenant)  # another tenant's: 404
    return session_out(session, attribution.session_totals(session.key), sessions.forecasts)


@router.post("/{session_id}/extend", response_model=SessionOut, responses=ERRORS)
def extend_session(
    session_id: SessionIdPath, body: SessionExtend, sessions: SessionsDep, tenant: TenantDep
) -> SessionOut:
    """Slide the session's expiry (optionally with a new TTL)."""
    session = sessions.extend(session_id, tenant=tenant, ttl_s=body.ttl_s)
    return session_out(session, forecasts=sessions.forecasts)


@router.post("/{session_id}/finish", response_model=SessionOut, responses=ERRORS)
def finish_session(
    session_id: SessionIdPath, body: SessionFinish, sessions: SessionsDep, tenant: TenantDep
) -> SessionOut:
    """The session's latest request finished, for ``finish_reason``: its blocks are kept or
    evicted by when the session is predicted back (a store's ``finish_reason`` says the same
    with the store)."""
    session = sessions.record(session_id, tenant=tenant, finish_reason=body.finish_reason)
    return session_out(session, forecasts=sessions.forecasts)


@router.delete("/{session_id}", status_code=204, responses=ERRORS)
def close_session(session_id: SessionIdPath, sessions: SessionsDep, tenant: TenantDep) -> None:
    """Close the session: its pins go, its blocks age out by TTL."""
    sessions.close(session_id, tenant=tenant)
