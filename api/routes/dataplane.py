"""``GET /v1/dataplane``: where this node serves the binary block stream (docs/dataplane.md)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from sessioncache.api.deps import TenantDep
from sessioncache.dataplane.server import StreamServer

router = APIRouter(tags=["system"])


class DataplaneOut(BaseModel):
    stream: str | None = Field(
        description="`host:port` of the block stream; null when the node serves none. A "
        "wildcard host (`0.0.0.0`) means: the host of this REST URL"
    )
    connections: int = Field(description="block-stream connections open now")
    same_host: str | None = Field(
        None,
        description="path of the same-host Unix socket (shared memory, trusted tenants "
        "only); null when the node serves none",
    )
    same_host_connections: int = Field(0, description="same-host connections open now")


@router.get("/v1/dataplane", response_model=DataplaneOut)
def dataplane(request: Request, tenant: TenantDep) -> DataplaneOut:
    server: StreamServer | None = request.app.state.dataplane
    same_host: StreamServer | None = getattr(request.app.state, "same_host", None)
    return DataplaneOut(
        stream=server.advertise if server is not None else None,
        connections=server.connections() if server is not None else 0,
        same_host=same_host.address if same_host is not None else None,
        same_host_connections=same_host.connections() if same_host is not None else 0,
    )
