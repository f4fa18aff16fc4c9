"""Dependencies shared by the routers, as ``Annotated`` aliases.

A route depends on what it calls: ``NodeDep`` for the tenant-aware data path (lookup, store,
upload, block reads: ``CacheNode`` methods), ``SessionsDep`` and ``StoreDep`` for the
components themselves, never ``node.sessions``/``node.store`` reached through the node.

The node and tenant dependencies are ``async def`` on purpose: they only read the request and
a dict, and FastAPI runs a plain ``def`` dependency in its thread pool: a thread hop for every
``/v1`` request."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from sessioncache.api.admin.auth import AdminAuth
from sessioncache.attribution import Attribution
from sessioncache.errors import AdminRequired, AuthRefused
from sessioncache.node import CacheNode
from sessioncache.routing.scoring import Router
from sessioncache.sessions.manager import SessionManager
from sessioncache.store import TieredStore


async def get_node(request: Request) -> CacheNode:
    node: CacheNode = request.app.state.node
    return node


NodeDep = Annotated[CacheNode, Depends(get_node)]


async def get_sessions(node: NodeDep) -> SessionManager:
    return node.sessions


async def get_store(node: NodeDep) -> TieredStore:
    return node.store


async def get_attribution(node: NodeDep) -> Attribution:
    return node.attribution


SessionsDep = Annotated[SessionManager, Depends(get_sessions)]
AttributionDep = Annotated[Attribution, Depends(get_attribution)]
StoreDep = Annotated[TieredStore, Depends(get_store)]


def bearer_key(request: Request) -> str | None:
    """The key of ``Authorization: Bearer <key>``, None without one."""
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return None


def source_address(request: Request) -> str:
    """The address the request's connection comes from: what wrong tokens count against
    (``admin.lockout``); behind a proxy, the proxy's."""
    return request.client.host if request.client is not None else ""


async def get_tenant(request: Request, node: NodeDep) -> str:
    """The caller's tenant from ``Authorization: Bearer <key>`` (the open tenant when auth is
    off)."""
    key = bearer_key(request)
    tenant = node.tenant_for_key(key)
    if tenant is None:
        raise AuthRefused("a valid API key is required: Authorization: Bearer <key>")
    return tenant


TenantDep = Annotated[str, Depends(get_tenant)]


async def get_router(request: Request) -> Router:
    router: Router = request.app.state.router
    return router


RouterDep = Annotated[Router, Depends(get_router)]
"""KV-aware routing: the engines' feeds and the route computation (sessioncache/routing)."""


async def get_admin(request: Request, node: NodeDep) -> None:
    """Admin operations (a sweep of every tenant's sessions): with an admin token set
    (``SESSIONCACHE_ADMIN_TOKEN``, the dashboard's), that token as a bearer key; without, only
    a node running open (no ``api_keys``) lets anyone in. A tenant's key is known but not
    enough (403, and not counted as a wrong token); anything else is 401, or 429 from an
    address locked for its wrong tokens (``admin.lockout``)."""
    key = bearer_key(request)
    if node.settings.admin_token is None and not node.auth_enabled:
        return
    if key is not None and node.auth_enabled and node.tenant_for_key(key) is not None:
        raise AdminRequired("this operation needs the admin token, not a tenant's key")
    auth: AdminAuth = request.app.state.admin_auth
    address = source_address(request)
    if key is not None and auth.token_matches(key, address):
        return
    wrong = AuthRefused("the admin token is required: Authorization: Bearer <token>")
    raise wrong if key is None else auth.refusal(address, wrong)


AdminDep = Annotated[None, Depends(get_admin)]
