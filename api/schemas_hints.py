"""Request bodies of agent hints (``POST /v1/sessions/{id}/hints``): each field format's
object, described as far as the node reads it and open to the rest (the formats grow); the
parsers behind them are ``sessioncache.sessions.hints``."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from sessioncache.api.schemas import (
    MAX_JSON_INT,
    JsonBool,
    PositiveJsonInt,
    SessionId,
    _json_number,
)

HintNumber = Annotated[float, Field(ge=0, allow_inf_nan=False), BeforeValidator(_json_number)]
HintCount = Annotated[int, Field(ge=0, le=MAX_JSON_INT), BeforeValidator(_json_number)]
HintPriority = Annotated[
    float, Field(ge=0, le=100, allow_inf_nan=False), BeforeValidator(_json_number)
]
HintText = Annotated[str, Field(min_length=1)]
HintId = HintText | Annotated[int, Field(ge=-MAX_JSON_INT, le=MAX_JSON_INT)]


class _Open(BaseModel):
    """A hint format's object: the fields the node reads are described, any other is left
    alone (the formats grow)."""

    model_config = ConfigDict(extra="allow")


class CacheControlIn(_Open):
    ttl: (
        Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False), BeforeValidator(_json_number)]
        | None
    ) = Field(None, description="Seconds (default 300).")


class HintEditIn(_Open):
    type: Literal["evict", "offload", "prefetch"]
    block_start: HintCount | None = Field(None, description="First block of the chain (0).")
    block_end: HintCount | None = Field(
        None, description="Block after the last (null: to the end; at most block_start: none)."
    )


class AgentHintIn(_Open):
    """uni-agent's (recognised by ``schema_version``, ``trajectory_id``, ``kv_priority`` or
    ``lease_until``) or vLLM's agent hint, and ``final``."""

    schema_version: Literal[1] | None = None
    trajectory_id: HintText | None = None
    kv_priority: (
        HintPriority | Literal["discard", "low", "neutral", "normal", "high", "keep"] | None
    ) = None
    lease_until: HintNumber | None = Field(None, description="Epoch seconds.")
    tools_available: list[str | dict[str, Any]] | None = None
    session_id: HintText | None = None
    parent_session_id: SessionId | None = None
    cache_control: CacheControlIn | None = None
    edits: list[HintEditIn] | None = None
    final: JsonBool | None = None


class AgentHintsIn(_Open):
    """SGLang's agent hints, and ``final``."""

    cache_ttl_ms: (
        Annotated[float, Field(gt=0, allow_inf_nan=False), BeforeValidator(_json_number)] | None
    ) = None
    reuse_hint: Literal["keep", "neutral", "discard"] | None = None
    expected_tool_duration_ms: HintNumber | None = None
    workflow_id: HintId | None = None
    agent_id: HintId | None = None
    step_id: HintId | None = None
    parent_step_id: HintId | None = None
    prefetch: JsonBool | None = None
    final: JsonBool | None = None


class RetentionDirectiveIn(_Open):
    start: HintCount = Field(description="First token position.")
    end: HintCount | None = Field(
        None, description="Token position after the last (null: to the end)."
    )
    priority: HintPriority
    duration: (
        Annotated[float, Field(gt=0, allow_inf_nan=False), BeforeValidator(_json_number)] | None
    ) = Field(None, description="Seconds.")


class SessionHints(_Open):
    """An agent hint in any of the field's formats (docs/sessions.md, "Agent hints"): a body
    as an engine's ``kv_transfer_params`` or ``SamplingParams.extra_args`` hold it. Other
    fields (a router forwarding a request's whole ``kv_transfer_params``) are left alone."""

    FORMATS: ClassVar[tuple[str, ...]] = ("agent_hint", "agent_hints", "retention_directives")
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "anyOf": [
                {"required": [name], "properties": {name: {"not": {"type": "null"}}}}
                for name in FORMATS
            ]
        },
    )

    agent_hint: AgentHintIn | None = Field(
        None,
        description="uni-agent's (schema_version 1: trajectory_id, kv_priority, lease_until, "
        "tools_available) or vLLM's agent hint (session_id, parent_session_id, "
        "cache_control.ttl, edits evict/offload/prefetch over block_start..block_end); final.",
    )
    agent_hints: AgentHintsIn | None = Field(
        None,
        description="SGLang's: cache_ttl_ms, reuse_hint (keep, neutral, discard), "
        "expected_tool_duration_ms, workflow_id, agent_id, step_id, parent_step_id, prefetch; "
        "final.",
    )
    retention_directives: list[RetentionDirectiveIn] | None = Field(
        None,
        min_length=1,
        description="vLLM's retention directives over token positions, priority "
        "non-increasing with position (one higher than the one before counts as that one; "
        "where they overlap, the later starts where the earlier ends).",
    )
    retention_scope: str | None = None
    block_tokens: PositiveJsonInt | None = Field(
        None,
        description="The engine's tokens per block: maps retention directives' token "
        "positions onto blocks of the session's chain (without it they rank it as a whole).",
    )
