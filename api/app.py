"""The FastAPI application: routers, error mapping, metrics, and the node's lifecycle."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI

from sessioncache import __version__
from sessioncache.api import errors, metrics, openapi
from sessioncache.api.admin.auth import AdminAuth
from sessioncache.api.limits import RequestGuard
from sessioncache.api.routes import (
    admin,
    blocks,
    dataplane,
    engines,
    lookup,
    namespaces,
    route,
    sessions,
    store,
    system,
)
from sessioncache.dataplane.server import StreamServer
from sessioncache.node import CacheNode
from sessioncache.routing.scoring import Router, open_router


def create_app(
    node: CacheNode,
    *,
    stream: StreamServer | None = None,
    same_host: StreamServer | None = None,
    router: Router | None = None,
) -> FastAPI:
    """An app serving ``node``; the app closes the node when it shuts down. ``stream`` (the
    data plane, bound but not started) and ``same_host`` (its Unix-socket server with the
    shared-memory ops) run from the app's start to its shutdown. ``router`` (KV-aware
    routing; by default one with the engines of the node's settings) is closed with it."""
    routing = router if router is not None else open_router(node)
    servers = [s for s in (stream, same_host) if s is not None]

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            for server in servers:
                server.start()  # threads of its own: nothing blocks the event loop
            yield
        finally:
            try:
                for server in servers:
                    # ends every connection (releasing its leases and staged slots) before
                    # the node closes; joining threads blocks, so off the event loop
                    await anyio.to_thread.run_sync(server.stop)
            finally:
                try:
                    await anyio.to_thread.run_sync(routing.close)
                finally:
                    node.close()

    app = FastAPI(
        title="sessioncache",
        version=__version__,
        summary="Prefix-caching KV-cache service for fleets of LLM inference engines",
        lifespan=lifespan,
    )
    app.state.node = node
    app.state.dataplane = stream
    app.state.same_host = same_host
    app.state.router = routing
    node.quotas.count("engines", routing.engines_per_tenant)
    app.state.metrics = metrics.install(app, node, routing)
    errors.install(app)
    app.state.admin_auth = AdminAuth.from_settings(node.settings)
    # outermost (added last): a head is checked before any route reads a byte of its body
    settings = node.settings
    app.add_middleware(
        RequestGuard,
        body_limit=settings.max_body_bytes,
        json_limit=settings.max_json_bytes,
        knows_key=(lambda key: key in settings.api_keys) if node.auth_enabled else None,
        admin_token=(
            settings.admin_token.get_secret_value() if settings.admin_token is not None else None
        ),
        hosts=frozenset({settings.host}),
    )
    openapi.install(app, node.settings)
    routers = (namespaces, lookup, store, blocks, sessions, system, dataplane, engines, route)
    for module in (*routers, admin):
        app.include_router(module.router)
    app.mount("/admin/static", admin.static_files(), name="admin-static")
    return app
