"""``GET /v1/dataplane``: where this node serves the binary block stream (docs/dataplane.md)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from api.deps import TenantDep
from sessioncache.dataplane.server import StreamServer

router = APIRouter(tags=["system"])


class DataplaneOut(BaseModel):
    stream: str | None = Field(
        description="`host:port` of the block stream; null when the node serves none. A "
        "wildcard host (`0.0.0.0`) means: the host of this REST URL"
    )
    connections: int = Field(description="block-stream connections open now")


@router.get("/v1/dataplane", response_model=DataplaneOut)
def dataplane(request: Request, tenant: TenantDep) -> DataplaneOut:
    server: StreamServer | None = request.app.state.dataplane
    if server is None:
        return DataplaneOut(stream=None, connections=0)
    return DataplaneOut(stream=server.advertise, connections=server.connections())
