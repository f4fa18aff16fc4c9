"""``/v1/engines``: the inference engines whose KV cache events the node follows."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter

from sessioncache.api.deps import NodeDep, RouterDep, TenantDep
from sessioncache.api.schemas import ERRORS, ErrorOut, NamespaceIn
from sessioncache.api.schemas_routing import EngineEvents, EngineId, EngineIn, EngineOut, EnginesOut
from sessioncache.errors import EngineNotFound
from sessioncache.routing.scoring import Router
from sessioncache.routing.subscriber import EngineSpec

router = APIRouter(prefix="/v1/engines", tags=["routing"])


def engine_out(routing: Router, spec: EngineSpec) -> EngineOut:
    status = routing.feeds.status(spec.engine_id)
    if status is None:  # removed meanwhile
        raise EngineNotFound(f"engine {routing.public_id(spec)!r} is not registered")
    counts, held = routing.index.counts(spec.engine_id)
    return EngineOut(
        engine_id=routing.public_id(spec),
        namespace=NamespaceIn(**asdict(spec.namespace)),
        endpoint=spec.endpoint,
        replay_endpoint=spec.replay_endpoint,
        topic=spec.topic,
        shared=spec.tenant is None,
        stale=status.stale,
        last_seq=status.last_seq,
        last_message_age_s=status.last_message_age_s,
        connects=status.connects,
        gaps=status.gaps,
        replays=status.replays,
        views_dropped=status.views_dropped,
        restarts=status.restarts,
        bad_messages=status.bad_messages,
        events=EngineEvents(**asdict(counts)),
        blocks=held,
    )


@router.post(
    "",
    response_model=EngineOut,
    status_code=201,
    responses={
        **ERRORS,
        403: {"model": ErrorOut},
        409: {"model": ErrorOut},
        429: {"model": ErrorOut},
    },
)
def register_engine(
    body: EngineIn, routing: RouterDep, node: NodeDep, tenant: TenantDep
) -> EngineOut:
    """Follow an engine's KV events from now on, for the caller's tenant. With API keys its
    endpoints must be under ``SESSIONCACHE_ENGINE_ENDPOINT_PREFIXES`` (by default: ``tcp://``
    at an IP address off this host) and no other tenant's (docs/routing.md)."""
    spec = EngineSpec(
        body.engine_id,
        body.namespace.to_namespace(),
        body.endpoint,
        body.replay_endpoint,
        body.topic,
        tenant,
    )
    routing.register(spec, by_tenant=True)
    return engine_out(routing, routing.get(tenant, spec.engine_id))


@router.get("", response_model=EnginesOut, responses=ERRORS)
async def list_engines(routing: RouterDep, tenant: TenantDep) -> EnginesOut:
    """The caller's engines and the shared ones, with their event counters."""
    out = []
    for spec in routing.visible(tenant):
        try:
            out.append(engine_out(routing, spec))
        except EngineNotFound:
            continue
    return EnginesOut(engines=out)


@router.get("/{engine_id}", response_model=EngineOut, responses=ERRORS)
async def get_engine(engine_id: EngineId, routing: RouterDep, tenant: TenantDep) -> EngineOut:
    return engine_out(routing, routing.get(tenant, engine_id))


@router.delete("/{engine_id}", status_code=204, responses=ERRORS)
async def delete_engine(engine_id: EngineId, routing: RouterDep, tenant: TenantDep) -> None:
    """Stop following the engine and forget what it holds."""
    routing.unregister(tenant, engine_id)
