"""Where sessioncache errors become HTTP answers: the status from ``sessioncache.errors.TABLE``,
the body ``{"error": <class name>, "detail": <message>}``."""

from __future__ import annotations

import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sessioncache.api.openapi import allowed_methods
from sessioncache.errors import SessionCacheError, http_status


def error_body(error: str, detail: str) -> dict[str, str]:
    return {"error": error, "detail": detail}


def install(app: FastAPI) -> None:
    @app.exception_handler(SessionCacheError)
    async def _sessioncache_error(request: Request, exc: SessionCacheError) -> JSONResponse:
        status = http_status(exc)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
        if exc.retry_after is not None:  # when to ask again (an unavailable dependency)
            headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
        return JSONResponse(
            error_body(type(exc).__name__, str(exc)), status_code=status, headers=headers or None
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
