"""Request and response bodies of ``/v1/engines`` and ``/v1/route`` (docs/routing.md)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from sessioncache.api.schemas import NamespaceIn, PromptIn, Strict

EngineId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")]
Endpoint = Annotated[
    str,
    Field(
        max_length=512,
        pattern=r"^(tcp|ipc|inproc)://\S+$",
        examples=["tcp://10.0.0.7:5557"],
    ),
]


class EngineIn(Strict):
    """An engine whose KV events the node follows; it binds ``endpoint`` (vLLM's
    ``--kv-events-config`` ``endpoint``, with the engine's host instead of ``*``). With API
    keys, both endpoints must be admitted by ``SESSIONCACHE_ENGINE_ENDPOINT_PREFIXES`` (403)
    and be no other tenant's nor a shared engine's (409)."""

    engine_id: EngineId
    namespace: NamespaceIn = Field(
        description="The engine's model and KV layout; block_tokens is its block size."
    )
    endpoint: Endpoint
    replay_endpoint: Endpoint | None = None
    topic: str = Field("", max_length=256)


class EngineEvents(BaseModel):
    batches: int
    events: int
    blocks_stored: int
    blocks_removed: int
    cleared: int
    skipped_blocks: int
    unknown_events: int


class EngineOut(BaseModel):
    engine_id: str
    namespace: NamespaceIn
    endpoint: str
    replay_endpoint: str | None
    topic: str
    shared: bool = Field(description="Registered in the settings for every tenant.")
    stale: bool = Field(
        description="Silent longer than engine_stale_s, or the node is behind on its events "
        "(a replay pending, messages queued): scores nothing."
    )
    last_seq: int | None
    last_message_age_s: float | None
    connects: int = Field(
        description="Connects of the node to the engine's endpoint seen (0: never reached); "
        "each asks the replay endpoint for what the node missed."
    )
    gaps: int
    replays: int
    views_dropped: int = Field(description="Gaps the replay could not fill: view rebuilt.")
    restarts: int
    bad_messages: int
    events: EngineEvents
    blocks: dict[str, int] = Field(description="Blocks held per medium (GPU, CPU, STORAGE).")


class EnginesOut(BaseModel):
    engines: list[EngineOut]


class RouteRequest(PromptIn):
    """A prompt by tokens, ``tokens_b64`` or ``block_ids_b64`` (``PromptIn``; by ids, only
    engines of the request's block size, and with API keys not the shared ones)."""

    session_id: None = Field(None, description="Not used by a route: null or absent.")
    engines: list[EngineId] | None = Field(
        None, max_length=1024, description="Only these engines (default: every visible one)."
    )


class EngineRouteOut(BaseModel):
    engine_id: str
    block_tokens: int
    matched_blocks: int
    matched_tokens: int
    per_medium: dict[str, int] = Field(
        description="Per medium, the tokens of the leading blocks held there."
    )
    score: float
    stale: bool
    shared: bool


class CacheRouteOut(BaseModel):
    block_tokens: int
    matched_blocks: int
    matched_tokens: int
    score: float


class RouteOut(BaseModel):
    prompt_tokens: int
    engines: list[EngineRouteOut] = Field(description="Best first.")
    cache: CacheRouteOut = Field(description="The prefix held in sessioncache's own tiers.")
