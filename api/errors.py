"""The only place where sessioncache errors become HTTP: one status per exception class."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sessioncache.api.openapi import allowed_methods
from sessioncache.errors import (
    BlockNotFound,
    DurableStoreFailed,
    EngineExists,
    EngineNotFound,
    InvalidInput,
    LeaseNotFound,
    PayloadSizeError,
    SessionCacheError,
    SessionNotFound,
    StoreRefused,
    UnknownTier,
    UploadRefused,
)

STATUS: list[tuple[type[SessionCacheError], int]] = [
    (PayloadSizeError, 422),
    (UnknownTier, 422),
    (InvalidInput, 422),
    (BlockNotFound, 404),
    (LeaseNotFound, 404),
    (SessionNotFound, 404),
    (UploadRefused, 403),
    (StoreRefused, 403),
    (EngineNotFound, 404),
    (EngineExists, 409),
    (DurableStoreFailed, 507),
]


class AuthRequired(SessionCacheError):
    """No or an unknown API key."""


class BodyTooLarge(SessionCacheError):
    """A request body beyond the configured limit."""


class AdminRequired(SessionCacheError):
    """A tenant's key on an operation that needs the admin token."""


class AdminAuthRequired(SessionCacheError):
    """No or a wrong admin token (cookie or bearer) on an ``/admin`` request."""


class AdminForbidden(SessionCacheError):
    """An ``/admin`` request refused whatever it carries: a mutation without its CSRF token,
    or the dashboard disabled (no admin token and not the local-only open mode)."""


STATUS += [(AuthRequired, 401), (BodyTooLarge, 413), (AdminAuthRequired, 401)]
STATUS += [(AdminRequired, 403), (AdminForbidden, 403)]


def error_body(error: str, detail: str) -> dict[str, str]:
    return {"error": error, "detail": detail}


def status_of(exc: SessionCacheError) -> int:
    for cls, status in STATUS:
        if isinstance(exc, cls):
            return status
    return 500


def install(app: FastAPI) -> None:
    @app.exception_handler(SessionCacheError)
    async def _sessioncache_error(request: Request, exc: SessionCacheError) -> JSONResponse:
        status = status_of(exc)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return JSONResponse(
            error_body(type(exc).__name__, str(exc)), status_code=status, headers=headers
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors()[:10]:
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{where}: {err.get('msg', 'invalid')}" if where else err.get("msg", ""))
        return JSONResponse(
            error_body("ValidationError", "; ".join(parts) or "invalid request"), status_code=422
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            # Starlette names the methods of the first route whose path matched; a path can
            # have several (GET and DELETE /v1/sessions/{id} are two routes)
            headers["Allow"] = ", ".join(allowed_methods(request.app, request.url.path))
        return JSONResponse(
            error_body("HTTPError", str(exc.detail)),
            status_code=exc.status_code,
            headers=headers or None,
        )
