"""The admin dashboard: ``/admin`` (the page), ``/admin/static`` (its files) and
``/admin/api/*`` (the JSON it polls and the actions it takes). Access: ``admin.auth``.

Every route but the page and login needs an admin (``AdminDep``); the mutating ones also the
CSRF token (``MutationDep``). The page itself holds no data, so it is served to anyone: it
shows the login form until ``GET /admin/api/session`` answers.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

from sessioncache.api.admin import overview
from sessioncache.api.admin.auth import COOKIE, CSRF_HEADER, Admin, AdminAuth
from sessioncache.api.deps import NodeDep, SessionsDep, StoreDep, source_address
from sessioncache.errors import AdminAuthRequired, AdminForbidden
from sessioncache.sessions.query import SessionQuery, SortKey

router = APIRouter(prefix="/admin", tags=["admin"], include_in_schema=False)

STATIC = files("sessioncache.api.admin") / "static"
# the page loads nothing from elsewhere (air-gapped clusters); uPlot sets inline styles
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; form-action 'self'"
)


def static_files() -> StaticFiles:
    return StaticFiles(directory=str(STATIC))


async def get_auth(request: Request) -> AdminAuth:
    auth: AdminAuth = request.app.state.admin_auth
    return auth


AuthDep = Annotated[AdminAuth, Depends(get_auth)]


async def require_admin(request: Request, auth: AuthDep) -> Admin:
    if auth.mode == "disabled":
        raise AdminForbidden(
            "the dashboard is off: set SESSIONCACHE_ADMIN_TOKEN (it is served without one "
            "only when the service runs open, without API keys, on loopback)"
        )
    if auth.mode == "open":
        return Admin("open", auth.open_csrf)
    header = request.headers.get("authorization")
    if header is not None:
        scheme, _, value = header.partition(" ")
        address = source_address(request)
        if scheme.lower() == "bearer" and auth.token_matches(value.strip(), address):
            return Admin("bearer", None)
        raise auth.refusal(address, AdminAuthRequired("wrong admin token"))
    cookie = request.cookies.get(COOKIE)
    login = auth.session(cookie) if cookie else None
    if login is None:
        raise AdminAuthRequired("log in with the admin token (SESSIONCACHE_ADMIN_TOKEN)")
    return Admin("cookie", login.csrf)


AdminDep = Annotated[Admin, Depends(require_admin)]


async def require_mutation(request: Request, admin: AdminDep, auth: AuthDep) -> Admin:
    if not auth.csrf_matches(admin, request.headers.get(CSRF_HEADER)):
        raise AdminForbidden("missing or wrong CSRF token (X-CSRF-Token)")
    return admin


MutationDep = Annotated[Admin, Depends(require_mutation)]


# -- the page and the login ---------------------------------------------------------------


@router.get("", response_class=HTMLResponse)
def page() -> HTMLResponse:
    html = (STATIC / "admin.html").read_text(encoding="utf-8")
    return HTMLResponse(
        html,
        headers={
            "Content-Security-Policy": CSP,
            "X-Frame-Options": "DENY",
            "Cache-Control": "no-store",
            "Referrer-Policy": "no-referrer",
        },
    )


class LoginIn(BaseModel):
    token: str = Field(min_length=1, max_length=4096)


@router.post("/api/login", status_code=204)
def login(body: LoginIn, request: Request, response: Response, auth: AuthDep) -> None:
    if auth.mode != "token":
        raise AdminForbidden(f"no login in mode {auth.mode!r}")
    address = source_address(request)
    made = auth.login(body.token, address)
    if made is None:
        raise auth.refusal(address, AdminAuthRequired("wrong admin token"))
    response.set_cookie(
        COOKIE,
        made.session_id,
        max_age=int(auth.login_ttl_s),
        path="/admin",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


@router.post("/api/logout", status_code=204)
def logout(request: Request, response: Response, auth: AuthDep, admin: MutationDep) -> None:
    cookie = request.cookies.get(COOKIE)
    if cookie:
        auth.logout(cookie)
    response.delete_cookie(COOKIE, path="/admin")


@router.get("/api/session")
def session(admin: AdminDep, auth: AuthDep) -> dict[str, Any]:
    """Who is asking, and the CSRF token the page echoes on mutations."""
    return {"via": admin.via, "mode": auth.mode, "csrf": admin.csrf}


# -- figures ------------------------------------------------------------------------------


@router.get("/api/overview")
def get_overview(
    request: Request, node: NodeDep, store: StoreDep, admin: AdminDep
) -> dict[str, Any]:
    return overview.overview(node, store, request.app.state.request_latency)


@router.get("/api/history")
def get_history(
    node: NodeDep, admin: AdminDep, since: Annotated[float | None, Query()] = None
) -> dict[str, Any]:
    return overview.history(node, since)


@router.get("/api/namespaces")
def get_namespaces(node: NodeDep, store: StoreDep, admin: AdminDep) -> dict[str, Any]:
    return overview.namespaces(node, store)


# -- sessions ---------------------------------------------------------------------------


@router.get("/api/sessions")
def list_sessions(
    node: NodeDep,
    store: StoreDep,
    sessions: SessionsDep,
    admin: AdminDep,
    q: Annotated[str, Query(max_length=200)] = "",
    sort: SortKey = "last_seen",
    order: Literal["asc", "desc"] = "desc",
    offset: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    tenant: str | None = None,
) -> dict[str, Any]:
    """Open sessions, searched (id or tenant substring), sorted and paginated."""
    query = SessionQuery(
        search=q,
        sort=sort,
        descending=order == "desc",
        offset=offset,
        limit=limit,
        tenant=tenant,
    )
    page_ = sessions.page(query)
    hits = node.session_hit_tokens([s.key for s in page_.sessions])
    return {
        "total": page_.total,
        "offset": offset,
        "limit": limit,
        "sessions": [overview.session_row(store, s, hits[s.key]) for s in page_.sessions],
    }


# A session is named by its tenant and its id: ids are scoped by tenant.
ONE = "/api/sessions/{tenant}/{session_id}"


@router.get(ONE)
def get_session(
    tenant: str,
    session_id: str,
    node: NodeDep,
    store: StoreDep,
    sessions: SessionsDep,
    admin: AdminDep,
) -> dict[str, Any]:
    return overview.session_detail(node, store, sessions.get(session_id, tenant=tenant))


class ExtendIn(BaseModel):
    ttl_s: float | None = Field(None, gt=0, description="a new TTL; none: slide the current one")


@router.post(ONE + "/extend")
def extend_session(
    tenant: str,
    session_id: str,
    body: ExtendIn,
    node: NodeDep,
    store: StoreDep,
    sessions: SessionsDep,
    admin: MutationDep,
) -> dict[str, Any]:
    extended = sessions.extend(session_id, tenant=tenant, ttl_s=body.ttl_s)
    hits = node.session_hit_tokens([extended.key])[extended.key]
    return overview.session_row(store, extended, hits)


@router.post(ONE + "/close", status_code=204)
def close_session(tenant: str, session_id: str, sessions: SessionsDep, admin: MutationDep) -> None:
    """Close: the pins go, the blocks age out by their TTL."""
    sessions.close(session_id, tenant=tenant)


@router.post(ONE + "/purge")
def purge_session(
    tenant: str, session_id: str, store: StoreDep, sessions: SessionsDep, admin: MutationDep
) -> dict[str, int]:
    """Close and drop the session's chain from every tier now (blocks another live session
    pins, or a lease holds, stay)."""
    session = sessions.get(session_id, tenant=tenant)
    chain = store.reads.chain_to(session.head) if session.head is not None else []
    sessions.close(session_id, tenant=tenant)
    return {"dropped_blocks": store.writes.delete(chain[::-1])}  # tail first
