"""The FastAPI application: routers, error mapping, metrics, and the node's lifecycle."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api import errors, metrics
from api.routes import blocks, lookup, namespaces, sessions, store, system
from sessioncache import __version__
from sessioncache.service import CacheNode


def create_app(node: CacheNode) -> FastAPI:
    """An app serving ``node``; the app closes the node when it shuts down."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            node.close()

    app = FastAPI(
        title="sessioncache",
        version=__version__,
        summary="Prefix-caching KV-cache service for fleets of LLM inference engines",
        lifespan=lifespan,
    )
    app.state.node = node
    app.state.registry = metrics.install(app, node)
    errors.install(app)
    for module in (namespaces, lookup, store, blocks, sessions, system):
        app.include_router(module.router)
    return app
