"""Dependencies shared by the routers, as ``Annotated`` aliases.

A route depends on what it calls: ``NodeDep`` for the tenant-aware data path (lookup, store,
upload, block reads: ``CacheNode`` methods), ``SessionsDep`` and ``StoreDep`` for the
components themselves, never ``node.sessions``/``node.store`` reached through the node.

The node and tenant dependencies are ``async def`` on purpose: they only read the request and
a dict, and FastAPI runs a plain ``def`` dependency in its thread pool, a thread hop each that
cost every ``/v1`` request about 0.25 ms of CPU (measured in-process; about a third of an
empty request)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from sessioncache.api.errors import AuthRequired
from sessioncache.attribution import Attribution
from sessioncache.node import CacheNode
from sessioncache.routing.scoring import Router
from sessioncache.sessions import SessionManager
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


async def get_tenant(request: Request, node: NodeDep) -> str:
    """The caller's tenant from ``Authorization: Bearer <key>`` (the open tenant when auth is
    off)."""
    header = request.headers.get("authorization")
    key = None
    if header is not None:
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            key = value.strip()
    tenant = node.tenant_for_key(key)
    if tenant is None:
        raise AuthRequired("a valid API key is required: Authorization: Bearer <key>")
    return tenant


TenantDep = Annotated[str, Depends(get_tenant)]


async def get_router(request: Request) -> Router:
    router: Router = request.app.state.router
    return router


RouterDep = Annotated[Router, Depends(get_router)]
"""KV-aware routing: the engines' feeds and the route computation (sessioncache/routing)."""
