"""The FastAPI application: routers, error mapping, metrics, and the node's lifecycle."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI

from api import errors, metrics
from api.routes import blocks, dataplane, lookup, sessions, store, system
from sessioncache import __version__
from sessioncache.dataplane.server import StreamServer
from sessioncache.service import CacheNode


def create_app(node: CacheNode, *, stream: StreamServer | None = None) -> FastAPI:
    """An app serving ``node``; the app closes the node when it shuts down. ``stream`` (the
    data plane, bound but not started) runs from the app's start to its shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            if stream is not None:
                stream.start()  # threads of its own: nothing blocks the event loop
            yield
        finally:
            try:
                if stream is not None:
                    # ends every connection (releasing its leases) before the node closes;
                    # joining threads blocks, so off the event loop
                    await anyio.to_thread.run_sync(stream.stop)
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
    app.state.registry = metrics.install(app, node)
    errors.install(app)
    for module in (lookup, store, blocks, sessions, system, dataplane):
        app.include_router(module.router)
    return app
