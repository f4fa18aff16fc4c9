"""What the vLLM connector (``connector.vllm``) reads of vLLM's configuration and requests:
its settings (``kv_connector_extra_config``), the namespace of an engine's KV
(``vllm_namespace``), whether the engine can attend to a cached context
(``cannot_attend_to_cache``), and a request's scope and finish reason (``request_scope``,
``finish_reason``). ``connector.vllm`` imports it, and it imports vLLM itself only where
``vllm_namespace`` asks for the platform's device type.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sessioncache.connector.hybrid import DEFAULT_CHECKPOINT_BLOCKS
from sessioncache.connector.paged import NodeSettings, Scope
from sessioncache.connector.transfer import DEFAULT_LEASE_MS
from sessioncache.dataplane.frames import FINISH_REASONS
from sessioncache.hashing import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

log = logging.getLogger("vllm.sessioncache")
"""``connector.vllm``'s: under vLLM's logger, whose handlers print in every engine process."""


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """``kv_connector_extra_config``."""

    url: str
    api_key: str | None = None
    data_path: str = "auto"
    model: str | None = None
    """The model's name in the namespace (default: vLLM's served model name)."""
    lease_ms: int = DEFAULT_LEASE_MS
    timeout_s: float = 5.0
    save: bool = True
    load: bool = True
    copy_threads: int | None = None
    """Threads that copy a load's blocks into the paged cache on the host (default:
    ``paged.default_copy_threads``)."""
    checkpoint_blocks: int = DEFAULT_CHECKPOINT_BLOCKS
    """Hybrid models: blocks between two checkpoints of a prefix, besides the turn
    boundaries (0: turn boundaries only; docs/hybrid.md)."""
    capture_bytes: int = 256 << 20
    """Hybrid models: most bytes of checkpoints a worker holds for running requests."""

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorSettings:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"SessionCacheConnector: unknown kv_connector_extra_config {unknown}")
        if not extra.get("url"):
            raise ValueError('SessionCacheConnector needs kv_connector_extra_config {"url": ...}')
        return cls(**extra)

    def node(self) -> NodeSettings:
        return NodeSettings(self.url, self.api_key, self.data_path, self.lease_ms, self.timeout_s)


def vllm_namespace(
    config: VllmConfig,
    settings: ConnectorSettings,
    *,
    rank: int,
    salt: str | None,
    lora: str | None,
) -> Namespace:
    """The namespace of this engine's KV at one tensor-parallel ``rank``."""
    model = config.model_config
    parallel = config.parallel_config
    cache = config.cache_config
    name = settings.model or model.served_model_name or model.model
    if isinstance(name, list):
        name = name[0]
    dtype = cache.cache_dtype if cache.cache_dtype != "auto" else str(model.dtype)
    from vllm.platforms import current_platform

    if model.use_mla:  # one latent vector a token, shared by the heads: named by its parts
        text = model.hf_text_config
        heads = f"mla{text.kv_lora_rank}+{text.qk_rope_head_dim}"
    else:
        heads = f"h{model.get_num_kv_heads(parallel)}x{model.get_head_size()}"
    layout = (
        f"vllm-paged/{current_platform.device_type}/l{model.get_num_layers(parallel)}"
        f"/{heads}/tp{parallel.tensor_parallel_size}.{rank}"
    )
    return Namespace(
        str(name), cache.block_size, str(dtype).removeprefix("torch."), layout, salt, lora
    )


def cannot_attend_to_cache(config: VllmConfig) -> str | None:
    """Why this engine cannot continue a prompt from a cached context, or None when it can.

    vLLM's platform check turns prefix caching and chunked prefill off together where the
    attention backend cannot attend to KV it did not compute in the same step (its CPU
    build does so for MLA on CPUs without AMX). A load into such an engine would be read by
    nothing, or read wrongly: the connector then loads nothing (and still saves)."""
    cache, scheduler = config.cache_config, config.scheduler_config
    if cache.enable_prefix_caching or scheduler.enable_chunked_prefill:
        return None
    mla = config.model_config is not None and config.model_config.use_mla
    return (
        "vLLM runs this engine with prefix caching and chunked prefill off: its "
        f"{'MLA ' if mla else ''}attention backend computes a prompt in one step, from nothing "
        "cached"
    )


def request_scope(request: Request) -> Scope:
    params = request.kv_transfer_params or {}
    session = params.get("session_id")
    key = params.get("api_key")
    lora = request.lora_request.lora_name if request.lora_request is not None else None
    return Scope(
        request.cache_salt, lora, str(session) if session else None, str(key) if key else None
    )


VLLM_FINISH_REASONS = {
    "STOP": "stop",
    "LENGTH": "length",
    "ABORT": "abort",
    "ERROR": "error",
    "REPETITION": "stop",
}
"""vLLM's ``FinishReason`` names and the finish reasons sessioncache takes for them (a
repetition stops the output: the turn ends for the user, as at a stop)."""


def finish_reason(request: Request) -> str | None:
    """Why a finished request of a session finished, as the connector tells the node: the
    client's ``kv_transfer_params["finish_reason"]`` when it gives a known one (an agent
    knows its turn ended in a tool call: ``tool_use``), else vLLM's (``VLLM_FINISH_REASONS``);
    None for a request naming no session."""
    params = request.kv_transfer_params or {}
    if not params.get("session_id"):
        return None
    given = params.get("finish_reason")
    if given is not None:
        if given in FINISH_REASONS:
            return str(given)
        log.warning(
            "sessioncache: request %s: unknown finish_reason %r (known: %s); vLLM's is passed",
            request.request_id,
            given,
            ", ".join(sorted(FINISH_REASONS)),
        )
    reason = request.get_finished_reason()
    return VLLM_FINISH_REASONS.get(reason.name) if reason is not None else None
