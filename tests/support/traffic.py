"""Agent-like traffic through the client library, for tests (and the dashboard screenshot)
that want a service with real figures: sessions growing turn by turn, lookups hitting their
prefix, a shared system prompt, two tenants and two models."""

from __future__ import annotations

import numpy as np

from sessioncache.connector import SessionCacheClient
from sessioncache.hashing import Namespace

BLOCK_TOKENS = 16
BLOCK_BYTES = 4096
MODELS = (
    Namespace("llama-3-8b", BLOCK_TOKENS, "bf16", "layer_major"),
    Namespace("qwen-2.5-7b", BLOCK_TOKENS, "bf16", "layer_major"),
)


def payload(i: int) -> bytes:
    return bytes([i % 251]) * BLOCK_BYTES


def agent_traffic(
    url: str,
    api_key: str | None,
    *,
    sessions: int = 4,
    turns: int = 3,
    prefix: str = "agent",
    model: int = 0,
    seed: int = 0,
) -> list[str]:
    """``sessions`` sessions of ``turns`` turns each: every turn looks up the conversation so
    far in its session (the earlier turns hit) and stores it. Returns the session ids."""
    rng = np.random.default_rng(seed)
    system = [int(t) for t in rng.integers(0, 32000, BLOCK_TOKENS * 4)]
    ids = []
    with SessionCacheClient(url, namespace=MODELS[model], api_key=api_key, timeout=30) as client:
        for s in range(sessions):
            session = client.open_session(f"{prefix}-{seed}-{s}", kind="agent")
            ids.append(session.id)
            conversation = list(system)
            for _ in range(turns):
                conversation += [int(t) for t in rng.integers(0, 32000, BLOCK_TOKENS * 2)]
                hit = client.lookup(conversation, session_id=session.id)
                client.load(hit.hashes)  # the engine loads the hit's KV
                client.store(conversation, payload, session_id=session.id)
            client.lookup(conversation, session_id=session.id)  # the next turn's hit
    return ids
