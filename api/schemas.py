"""Request and response bodies of the v1 API (pydantic); ids travel as 32 lowercase hex."""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Self

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sessioncache.errors import InvalidInput
from sessioncache.hashing import Namespace, tokens_to_le_bytes

Hex = Annotated[
    str, Field(pattern=r"^[0-9a-f]{32}$", examples=["978094f41daae8306d3c953a61392c71"])
]
SessionId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^/\s]+$")]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NamespaceIn(Strict):
    """What makes KV incompatible; ids are computed exactly as in docs/hashing.md."""

    model: str = Field(min_length=1, max_length=512)
    block_tokens: int = Field(gt=0, le=1 << 16)
    kv_dtype: str = Field(min_length=1, max_length=64)
    kv_layout: str = Field(min_length=1, max_length=256)
    salt: str | None = Field(None, max_length=256)
    lora: str | None = Field(None, max_length=512)

    def to_namespace(self) -> Namespace:
        return Namespace(
            self.model, self.block_tokens, self.kv_dtype, self.kv_layout, self.salt, self.lora
        )


class TokensIn(Strict):
    """A prompt: ``tokens`` as a JSON list, or ``tokens_b64``: base64 of little-endian uint32."""

    namespace: NamespaceIn
    tokens: list[Annotated[int, Field(ge=0, lt=1 << 32)]] | None = None
    tokens_b64: str | None = None
    session_id: SessionId | None = None

    @model_validator(mode="after")
    def _one_token_form(self) -> Self:
        if (self.tokens is None) == (self.tokens_b64 is None):
            raise ValueError("give exactly one of tokens or tokens_b64")
        return self

    def token_bytes(self) -> bytes:
        if self.tokens is not None:
            return tokens_to_le_bytes(np.asarray(self.tokens, dtype=np.int64))
        assert self.tokens_b64 is not None
        try:
            raw = base64.b64decode(self.tokens_b64, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidInput(f"tokens_b64 is not valid base64: {exc}") from exc
        if len(raw) % 4:
            raise InvalidInput("tokens_b64 must decode to a whole number of uint32 (4-byte) ids")
        return raw


class LookupRequest(TokensIn):
    lease_ms: int | None = Field(None, gt=0, description="Pin the matched blocks this long.")
    locations: bool = Field(
        False,
        description="Also report, per matched block, which nodes of the fleet hold it and in "
        "which tiers (one Redis round trip per block: ask only when routing on it).",
    )


class BlockRef(BaseModel):
    hash: Hex
    tier: str


class LeaseOut(BaseModel):
    id: str
    expires_at: float


class LookupResponse(BaseModel):
    block_tokens: int
    matched_blocks: int
    matched_tokens: int
    blocks: list[BlockRef]
    lease: LeaseOut | None
    locations: list[dict[str, list[str]]] | None = Field(
        None, description="Per matched block: node id -> tiers (when asked, with a fleet)."
    )


class StoreRequest(TokensIn):
    ttl_s: float | None = Field(None, gt=0, description="Block TTL; at least the session's.")


class StoreResponse(BaseModel):
    block_tokens: int
    hashes: list[Hex]
    missing: list[Hex]


class BlockBatchRequest(Strict):
    hashes: list[Hex] = Field(min_length=1, max_length=4096)


class UploadResponse(BaseModel):
    hash: Hex
    stored: bool = Field(description="False when the block was already held.")
    durable: bool = Field(description="The block is on a durable tier (survives a crash).")


class SessionCreate(Strict):
    session_id: SessionId | None = None
    kind: str = Field("agent", min_length=1, max_length=64)
    ttl_s: float | None = Field(None, gt=0)


class SessionExtend(Strict):
    ttl_s: float | None = Field(None, gt=0)


class SessionOut(BaseModel):
    id: str
    tenant: str
    kind: str
    ttl_s: float
    created: float
    last_seen: float
    expires_at: float
    head: Hex | None
    pinned: bool


class SessionList(BaseModel):
    sessions: list[SessionOut]


class WhoAmI(BaseModel):
    tenant: str
    auth: bool


class TierStatsOut(BaseModel):
    name: str
    capacity_bytes: int
    used_bytes: int
    pinned_bytes: int
    blocks: int
    durable: bool


class StatsOut(BaseModel):
    blocks: int
    pinned_blocks: int
    leases: int
    sessions: int
    tiers: list[TierStatsOut]
    counters: dict[str, int]


class ErrorOut(BaseModel):
    error: str
    detail: str


ERRORS: dict[int | str, dict[str, object]] = {
    401: {"model": ErrorOut},
    404: {"model": ErrorOut},
    422: {"model": ErrorOut},
}
"""The error replies of the tenant routes (lookup, store, sessions), for the OpenAPI
description: bad or missing API key, unknown id, invalid body."""


class GcOut(BaseModel):
    expired_sessions: int
    idle_unpinned: int
    expired_blocks: int
