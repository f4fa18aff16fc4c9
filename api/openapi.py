"""The OpenAPI description says what the server enforces: every error reply it can give, the
session kinds this node is configured with, and the bearer scheme when API keys are on.

FastAPI describes what the route signatures say; the rest is enforced outside them (the error
handlers of ``api/errors.py``, the body limit of ``api/limits.py``, ``get_tenant``, the node's
settings) and is added here, once, when the description is first asked for. Schemathesis runs
over the result in tests/api/test_schemathesis.py: a reply the description does not allow, or a
request it allows that the server rejects, fails there.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from sessioncache.config import Settings

ERROR_REF = {"$ref": "#/components/schemas/ErrorOut"}

BODY_ERRORS = {
    "400": "The body is not parseable (not UTF-8, not JSON).",
    "413": "The body exceeds `max_body_bytes`.",
    "422": "The body, a path parameter or a query parameter is invalid.",
}
AUTH_ERRORS = {"401": "No or an unknown API key (`Authorization: Bearer <key>`)."}
ADMIN_ERRORS = {
    **AUTH_ERRORS,
    "403": "A tenant's key on an admin operation: it needs the admin token.",
}
PARAM_ERRORS = {"422": "A path or query parameter is invalid."}
PATH_ERRORS = {
    "404": "Nothing of that id for the caller (unknown, another tenant's, or not an id: a "
    "block id outside its pattern matches no route)."
}


OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs"})
"""Paths anyone may ask (probes and scrapers carry no key); every other operation needs a
tenant's key when ``api_keys`` is set."""

ADMIN_OPERATIONS = frozenset({("post", "/v1/gc")})
"""Operations that need an admin key (``get_admin``) rather than a tenant's."""


def _error_reply(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ERROR_REF}}}


def describe(app: FastAPI, settings: Settings) -> dict[str, Any]:
    """The app's OpenAPI description with the errors, kinds and security it enforces."""
    schema = get_openapi(
        title=app.title,
        version=app.version,
        summary=app.summary,
        description=app.description,
        routes=app.routes,
    )
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    # every validation error is rewritten by api/errors.py into ErrorOut
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    if settings.api_keys or settings.admin_token is not None:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            errors: dict[str, str] = {}
            parameters = operation.get("parameters", ())
            if parameters:
                errors.update(PARAM_ERRORS)
            if any(p.get("in") == "path" for p in parameters):
                errors.update(PATH_ERRORS)
            if "requestBody" in operation:
                errors.update(BODY_ERRORS)
            admin = (method, path) in ADMIN_OPERATIONS
            tenant = not admin and path not in OPEN_PATHS
            if admin:
                errors.update(ADMIN_ERRORS)
            elif tenant and settings.api_keys:
                errors.update(AUTH_ERRORS)
            if (admin and (settings.api_keys or settings.admin_token is not None)) or (
                tenant and settings.api_keys
            ):
                operation["security"] = [{"bearer": []}]
            responses = operation.setdefault("responses", {})
            for status, description in errors.items():
                reply = responses.get(status)
                if reply is None or "HTTPValidationError" in str(reply):
                    responses[status] = _error_reply(description)
    upload = schema["paths"].get("/v1/blocks/{block_hash}", {}).get("put")
    if upload is not None:
        upload["responses"]["507"] = _error_reply(
            "A durable upload the durable tier could not take (its filesystem full): the "
            "block is not durable; retry when space returns."
        )
    # limits that are settings, not constants of the models
    kind = schemas.get("SessionCreate", {}).get("properties", {}).get("kind")
    if kind is not None:
        kind["enum"] = sorted(settings.kind_ttls())
    lease = schemas.get("LookupRequest", {}).get("properties", {}).get("lease_ms", {})
    for form in lease.get("anyOf", ()):
        if form.get("type") == "integer":
            form["maximum"] = int(settings.max_lease_s * 1000)
    for model in ("LookupRequest", "StoreRequest"):
        tokens = schemas.get(model, {}).get("properties", {}).get("tokens", {})
        for form in tokens.get("anyOf", ()):
            if form.get("type") == "array":
                form["maxItems"] = settings.max_tokens
    return schema


def install(app: FastAPI, settings: Settings) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = describe(app, settings)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """The methods the description lists for the template ``path`` matches (its parameters'
    patterns included: ``/v1/blocks/batch`` is not a block id), upper case."""
    for template, pattern in _templates(app):
        if pattern.fullmatch(path):
            return sorted(m.upper() for m in app.openapi()["paths"][template])
    return []


def _templates(app: FastAPI) -> list[tuple[str, re.Pattern[str]]]:
    cached: list[tuple[str, re.Pattern[str]]] | None = getattr(app.state, "path_templates", None)
    if cached is not None:
        return cached
    templates = []
    for template, operations in app.openapi()["paths"].items():
        patterns: dict[str, str] = {}
        for operation in operations.values():
            for param in operation.get("parameters", ()):
                if param.get("in") == "path":
                    text = param.get("schema", {}).get("pattern", "^[^/]+$")
                    patterns[param["name"]] = text.removeprefix("^").removesuffix("$")
        regex = re.sub(
            r"\\{(\w+)\\}",
            lambda m, p=patterns: f"(?:{p.get(m.group(1), '[^/]+')})",  # type: ignore[misc]
            re.escape(template),
        )
        templates.append((template, re.compile(regex)))
    # literal paths first: /v1/blocks/batch before /v1/blocks/{block_hash}
    templates.sort(key=lambda item: item[0].count("{"))
    app.state.path_templates = templates
    return templates
