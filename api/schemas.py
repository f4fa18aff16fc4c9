"""Request and response bodies of the v1 API (pydantic); ids travel as 32 lowercase hex."""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, ClassVar, Literal, Self, cast

import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    WithJsonSchema,
    model_validator,
)
from pydantic import Strict as PydanticStrict
from pydantic.config import JsonDict

from sessioncache.codecs import KV_CODEC_PATTERN
from sessioncache.errors import InvalidInput
from sessioncache.hashing import (
    FIELD_LIMITS,
    HASH_BYTES,
    MAX_BLOCK_TOKENS,
    BlockHash,
    Namespace,
    tokens_to_le_bytes,
)
from sessioncache.sessions.manager import MAX_SESSION_ID_LEN, SESSION_ID_PATTERN
from sessioncache.store.forecast import FINISH_REASON_PATTERN
from sessioncache.store.results import MAX_TTL_S

Hex = Annotated[
    str, Field(pattern=r"^[0-9a-f]{32}$", examples=["978094f41daae8306d3c953a61392c71"])
]
SessionId = Annotated[
    str, Field(min_length=1, max_length=MAX_SESSION_ID_LEN, pattern=SESSION_ID_PATTERN)
]

FinishReason = Annotated[
    str,
    Field(
        pattern=FINISH_REASON_PATTERN,
        description="Why the session's request finished: a tool call (`tool_use`, "
        "`tool_calls`, ...: the agent comes back in seconds, with the tool's result), the end "
        "of a turn (`stop`, `end_turn`, ...: minutes or days), `length`, or `abort`. The "
        "session's blocks are kept or evicted by when it is predicted back (docs/sessions.md).",
        examples=["tool_use"],
    ),
]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _json_number(value: object) -> object:
    """Numbers only: pydantic's lax mode would take ``true`` or ``"5"`` for a number, which the
    OpenAPI description calls invalid. (Strict mode is no answer: it refuses ``5.0`` for an
    integer, which JSON Schema calls one.)"""
    if isinstance(value, bool | str):
        raise ValueError("must be a JSON number")
    return value


def _json_numbers(value: object) -> object:
    """``_json_number`` for every item of a list, at C speed for the usual all-int list."""
    if isinstance(value, list) and not set(map(type, value)) <= {int, float}:
        raise ValueError("must be a list of JSON numbers")
    return value


JsonInt = Annotated[int, BeforeValidator(_json_number)]
JsonFloat = Annotated[float, BeforeValidator(_json_number)]
JsonBool = Annotated[bool, PydanticStrict()]
MAX_JSON_INT = (1 << 53) - 1
"""The largest integer a JSON number carries exactly (and a float holds)."""
PositiveJsonInt = Annotated[int, Field(gt=0, le=MAX_JSON_INT), BeforeValidator(_json_number)]
TtlSeconds = Annotated[
    float,
    Field(gt=0, le=MAX_TTL_S, allow_inf_nan=False),
    BeforeValidator(_json_number),
]


class NamespaceIn(Strict):
    """What makes KV incompatible; ids are computed exactly as in docs/hashing.md."""

    model: str = Field(min_length=1, max_length=FIELD_LIMITS["model"])
    block_tokens: JsonInt = Field(gt=0, le=MAX_BLOCK_TOKENS)
    kv_dtype: str = Field(min_length=1, max_length=FIELD_LIMITS["kv_dtype"])
    kv_layout: str = Field(min_length=1, max_length=FIELD_LIMITS["kv_layout"])
    salt: str | None = Field(None, max_length=FIELD_LIMITS["salt"])
    lora: str | None = Field(None, max_length=FIELD_LIMITS["lora"])
    group: str | None = Field(None, max_length=FIELD_LIMITS["group"])
    kv_codec: str | None = Field(
        None,
        max_length=FIELD_LIMITS["kv_codec"],
        pattern=KV_CODEC_PATTERN,
        description="lossless, or a lossy int8/<G> or fp8/<G> (G: elements per scale, the "
        "head dimension): how the disk and Redis tiers may store this namespace's blocks",
    )

    def to_namespace(self) -> Namespace:
        return Namespace(
            self.model,
            self.block_tokens,
            self.kv_dtype,
            self.kv_layout,
            self.salt,
            self.lora,
            self.group,
            self.kv_codec,
        )


MAX_LOOKUP_IDS = 1 << 17
"""The most block ids one ``POST /v1/lookup`` may carry (2M tokens at 16-token blocks)."""

BLOCK_IDS_B64_PATTERN = r"^(?:[A-Za-z0-9+/]{64})*(?:[A-Za-z0-9+/]{22}==|[A-Za-z0-9+/]{43}=)?$"
"""Padded base64 of a whole number of 16-byte ids: every 3 ids are 64 characters, and one or
two more end in ``==`` or ``=``. The server checks the same by decoding (with messages that
say what is wrong); tests/api/test_lookup_ids.py checks that the two agree."""

_BLOCK_IDS_B64_MAX_LEN = 4 * -(-MAX_LOOKUP_IDS * HASH_BYTES // 3)

BlockIdsB64 = Annotated[
    str,
    WithJsonSchema(
        {
            "type": "string",
            "pattern": BLOCK_IDS_B64_PATTERN,
            "maxLength": _BLOCK_IDS_B64_MAX_LEN,
            "description": "base64 (padded, standard alphabet) of the concatenated 16-byte "
            f"block ids, root first: a multiple of 16 bytes, at most {MAX_LOOKUP_IDS} ids",
        }
    ),
]


def decode_block_ids(text: str) -> list[BlockHash]:
    """``block_ids_b64`` as ids; ``ValueError`` with a message saying what is wrong."""
    if len(text) > _BLOCK_IDS_B64_MAX_LEN:
        raise ValueError(
            f"block_ids_b64 is {len(text)} characters long: more than {MAX_LOOKUP_IDS} ids "
            f"({_BLOCK_IDS_B64_MAX_LEN} characters), the most one lookup may carry"
        )
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"block_ids_b64 is not valid base64: {exc}") from None
    if len(raw) % HASH_BYTES:
        raise ValueError(
            f"block_ids_b64 decodes to {len(raw)} bytes, not a whole number of "
            f"{HASH_BYTES}-byte block ids"
        )
    if len(raw) > MAX_LOOKUP_IDS * HASH_BYTES:
        raise ValueError(
            f"block_ids_b64 carries {len(raw) // HASH_BYTES} ids: more than {MAX_LOOKUP_IDS} "
            "ids, the most one lookup may carry"
        )
    # numpy's 16-byte void items become 16-byte bytes objects, 5x faster than slicing
    return cast(list[BlockHash], np.frombuffer(raw, dtype=f"V{HASH_BYTES}").tolist())


TOKENS_B64_PATTERN = r"^(?:[A-Za-z0-9+/]{16})*(?:[A-Za-z0-9+/]{6}==|[A-Za-z0-9+/]{11}=)?$"
"""Padded base64 of a whole number of 4-byte tokens: every 3 tokens are 16 characters, and
one or two more end in ``==`` or ``=``. The server checks the same by decoding
(``TokensIn.token_bytes``, with messages that say what is wrong)."""

TokensB64 = Annotated[
    str,
    WithJsonSchema(
        {
            "type": "string",
            "pattern": TOKENS_B64_PATTERN,
            "description": "base64 (padded, standard alphabet) of the tokens as little-endian "
            "uint32: a multiple of 4 bytes",
        }
    ),
]


def _exactly_one_of(forms: tuple[str, ...]) -> JsonDict:
    """The JSON schema of "exactly one of these fields is given and not null"."""
    return {
        "oneOf": [
            {"required": [name], "properties": {name: {"not": {"type": "null"}}}} for name in forms
        ]
    }


class TokensIn(Strict):
    """A prompt: ``tokens`` as a JSON list, or ``tokens_b64``: base64 of little-endian uint32."""

    FORMS: ClassVar[tuple[str, ...]] = ("tokens", "tokens_b64")
    """The prompt's alternative forms: a request gives exactly one."""

    model_config = ConfigDict(json_schema_extra=_exactly_one_of(FORMS))

    namespace: NamespaceIn
    tokens: (
        Annotated[list[Annotated[int, Field(ge=0, lt=1 << 32)]], BeforeValidator(_json_numbers)]
        | None
    ) = None
    tokens_b64: TokensB64 | None = None
    session_id: SessionId | None = None

    @model_validator(mode="after")
    def _one_prompt_form(self) -> Self:
        given = [name for name in self.FORMS if getattr(self, name) is not None]
        if len(given) != 1:
            names = ", ".join(self.FORMS[:-1]) + f" or {self.FORMS[-1]}"
            raise ValueError(
                f"give exactly one of {names}" + (f" (got {' and '.join(given)})" if given else "")
            )
        return self

    def token_bytes(self) -> bytes:
        if self.tokens is not None:
            return tokens_to_le_bytes(np.asarray(self.tokens, dtype=np.int64))
        if self.tokens_b64 is None:
            raise InvalidInput("the request carries no tokens")
        try:
            raw = base64.b64decode(self.tokens_b64, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidInput(f"tokens_b64 is not valid base64: {exc}") from exc
        if len(raw) % 4:
            raise InvalidInput("tokens_b64 must decode to a whole number of uint32 (4-byte) ids")
        return raw


class PromptIn(TokensIn):
    """A prompt by its tokens (the server computes the ids) or by the ids themselves,
    ``block_ids_b64``, computed by the client from ``POST /v1/namespaces/resolve``'s root."""

    FORMS: ClassVar[tuple[str, ...]] = ("tokens", "tokens_b64", "block_ids_b64")

    model_config = ConfigDict(json_schema_extra=_exactly_one_of(FORMS))

    block_ids_b64: BlockIdsB64 | None = None

    _block_ids: list[BlockHash] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _decode_block_ids(self) -> Self:
        if self.block_ids_b64 is not None:
            self._block_ids = decode_block_ids(self.block_ids_b64)
        return self

    def block_ids(self) -> list[BlockHash] | None:
        """The ids of ``block_ids_b64`` (None for a prompt by tokens)."""
        return self._block_ids


class LookupRequest(PromptIn):
    """A lookup of a prompt, by its tokens or its ids (``PromptIn``)."""

    model_config = ConfigDict(
        json_schema_extra={
            **_exactly_one_of(PromptIn.FORMS),
            # a declined lookup takes no lease (the operation answers 422 for one)
            "if": {"required": ["declined"], "properties": {"declined": {"const": True}}},
            "then": {"properties": {"lease_ms": {"type": "null"}}},
        }
    )

    lease_ms: PositiveJsonInt | None = Field(None, description="Pin the matched blocks this long.")
    locations: JsonBool = Field(
        False,
        description="Also report, per matched block, which nodes of the fleet hold it and in "
        "which tiers (one Redis round trip per block: ask only when routing on it).",
    )
    explain: JsonBool = Field(
        False,
        description="Also say why the tokens past the match missed (``miss``: the first "
        "missed block's reason and the missed tokens by reason; docs/prompt-stability.md).",
    )
    compact: JsonBool | None = Field(
        None,
        description="Answer without the per-block list (CompactLookupResponse: counts, the "
        "tiers run-length encoded, the lease). Default: true with block_ids_b64, false with "
        "tokens or tokens_b64.",
    )
    declined: JsonBool = Field(
        False,
        description="The caller will load nothing (its engine cannot continue from a cached "
        "context): nothing matches, nothing is leased or touched (no TTL or LRU moves), and "
        "every token counts as missed, those the node holds for the caller as `declined` "
        "(docs/prompt-stability.md). Takes no lease_ms.",
    )

    @property
    def answer_compact(self) -> bool:
        return self.compact if self.compact is not None else self.block_ids_b64 is not None


class BlockRef(BaseModel):
    hash: Hex
    tier: str


class LeaseOut(BaseModel):
    id: str
    expires_at: float


LeaseCut = Annotated[
    Literal["pin_share"] | None,
    Field(
        description="The bound that cut the match, and its lease, short of what the node "
        "holds: `pin_share` when leasing more would pass the tenant's share of a tier (the "
        "rest is held, not leased: release leases or look up less); null when nothing did."
    ),
]


MissReason = Literal["diverged", "evicted", "expired", "new", "declined"]


class MissTokensOut(BaseModel):
    """Missed tokens by reason (they add up to the missed tokens)."""

    diverged: int
    evicted: int
    expired: int
    new: int
    declined: int = Field(
        description="Held, but the lookup's caller loads nothing (a declined lookup)."
    )


class MissOut(BaseModel):
    """Why a lookup missed: its first missed block (docs/prompt-stability.md)."""

    reason: MissReason | None = Field(description="The first missed block's; null: no miss.")
    block: int | None = Field(None, description="Index of the first missed block.")
    token: int | None = Field(
        None,
        description="Index of its first token; for diverged, of the first token that differs "
        "from the session's previous prompt (when both came as tokens).",
    )
    offset: int | None = Field(
        None, description="diverged: the first differing token's position inside the block."
    )
    tier: str | None = Field(None, description="evicted/expired: the tier its last copy left.")
    ago_s: float | None = Field(
        None, description="evicted: seconds since it left; expired: since its TTL ran out."
    )
    pressure: Literal["capacity", "pin_budget"] | None = Field(
        None,
        description="evicted: room for other blocks, or the session's pins had been "
        "dropped by the pin budget.",
    )
    tokens: MissTokensOut


class _LookupAnswer(BaseModel):
    """What a lookup's answer holds in both its forms."""

    block_tokens: int
    matched_blocks: int
    matched_tokens: int
    lease: LeaseOut | None
    lease_cut: LeaseCut = None
    locations: list[dict[str, list[str]]] | None = Field(
        None, description="Per matched block: node id -> tiers (when asked, with a fleet)."
    )
    miss: MissOut | None = Field(None, description="Why it missed (when asked: explain).")


class LookupResponse(_LookupAnswer):
    blocks: list[BlockRef]


class TierRun(BaseModel):
    tier: str
    blocks: int = Field(gt=0)


class CompactLookupResponse(_LookupAnswer):
    """A lookup's answer without the per-block list (the caller already has the ids: they are
    the first ``matched_blocks`` of its own)."""

    tiers: list[TierRun] = Field(
        description="The fastest tier holding each matched block, run-length encoded root "
        'first: 2,000 blocks in cpu then 48 on disk are [{"tier": "cpu", "blocks": 2000}, '
        '{"tier": "disk", "blocks": 48}].'
    )


class ResolveRequest(Strict):
    namespace: NamespaceIn


class ResolveResponse(BaseModel):
    root: Hex = Field(
        description="The namespace root the node hashes under for the caller (tenant salt "
        "applied): block 0's parent in docs/hashing.md."
    )
    block_tokens: int
    hash_seed: int = Field(ge=0, lt=1 << 64, description="The seed of every digest.")


def _needs(field: str, needed: str) -> JsonDict:
    """The JSON schema of "``field`` given and not null needs ``needed`` given and not null"."""
    return {
        "if": {"required": [field], "properties": {field: {"not": {"type": "null"}}}},
        "then": {"required": [needed], "properties": {needed: {"not": {"type": "null"}}}},
    }


class StoreRequest(TokensIn):
    model_config = ConfigDict(
        json_schema_extra={
            **_exactly_one_of(TokensIn.FORMS),
            **_needs("finish_reason", "session_id"),
        }
    )

    ttl_s: TtlSeconds | None = Field(None, description="Block TTL; at least the session's.")
    finish_reason: FinishReason | None = Field(
        None,
        description="With `session_id`: the request whose KV this is has finished, for this "
        "reason (a 422 without `session_id`).",
    )


class StoreResponse(BaseModel):
    block_tokens: int
    hashes: list[Hex]
    missing: list[Hex]


class BlockBatchRequest(Strict):
    hashes: list[Hex] = Field(min_length=1, max_length=4096)


class UploadResponse(BaseModel):
    hash: Hex
    stored: bool = Field(description="False when the block was already held.")
    status: Literal["stored", "present"] = Field(
        description="What the node did with the block: stored it, or held it already."
    )
    durable: bool = Field(description="The block is on a durable tier (survives a crash).")


class SessionCreate(Strict):
    session_id: SessionId | None = None
    kind: str = Field("agent", min_length=1, max_length=64)
    ttl_s: TtlSeconds | None = Field(None)
    parent: SessionId | None = Field(
        None,
        description="The session this one was forked from (a subagent's), of the caller's: "
        "closing this one spares the prefix they share.",
    )


class SessionExtend(Strict):
    ttl_s: TtlSeconds | None = Field(None)


class SessionFinish(Strict):
    finish_reason: FinishReason


class SessionHintOut(BaseModel):
    """A session's agent hints as they stand."""

    ttl_s: float | None = Field(
        description="The soft TTL: its chain stays pinned this long past its last activity "
        "(capped at 3600 s and the session's TTL; the pin budget still breaks it)."
    )
    priority: int | None = Field(description="0-100 (50: neutral; keep 100, discard 0).")
    final: bool = Field(description="The session said it is done: its requests pin nothing.")
    back_at: float | None = Field(
        description="When a hint said it comes back (unix seconds; a tool's duration, a lease)."
    )


class PrefetchOut(BaseModel):
    """What became of a prefetch of a session's chain into the first tier."""

    outcome: Literal["accepted", "deferred", "rejected"]
    reason: str
    blocks: int


class DivergenceOut(BaseModel):
    """Where a prompt of the session first differed from its previous prompt."""

    block: int
    offset: int | None = Field(description="Position inside the block (null: ids only).")
    token: int
    at: float
    lost_blocks: int = Field(description="Cached blocks of the previous prompt made unusable.")


class SessionAttributionOut(BaseModel):
    lookups: int
    hit_tokens: int
    miss_tokens: MissTokensOut
    last_divergence: DivergenceOut | None


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
    expected_back: float | None = Field(
        None,
        description="When the session is predicted back (unix seconds): the forecast its "
        "blocks are evicted by (docs/sessions.md); null under SESSIONCACHE_EVICTION_POLICY=lru "
        "or before its first request on this node.",
    )
    last_finish: str | None = Field(
        None,
        description="The class of its latest request's finish (tool, stop, length, abort), "
        "once told; null while it runs.",
    )
    attribution: SessionAttributionOut | None = Field(
        None, description="Its lookups' tokens, hit and missed by reason (GET of one session)."
    )
    hint: SessionHintOut | None = Field(
        None, description="Its agent hints as they stand (null: none; docs/sessions.md)."
    )
    resident: dict[str, int] | None = Field(
        None,
        description='Blocks of its chain per tier, e.g. {"cpu": 12, "disk": 4} (GET of '
        "one session).",
    )
    prefetch: PrefetchOut | None = Field(
        None, description="The prefetch its hint asked for (POST .../hints only)."
    )


class SessionList(BaseModel):
    sessions: list[SessionOut]


class WhoAmI(BaseModel):
    tenant: str
    auth: bool


class TierStatsOut(BaseModel):
    name: str
    capacity_bytes: int
    room_bytes: int
    """What it could hold now: ``capacity_bytes``, or less where its filesystem has less
    room (the disk tier's files share it: it evicts by policy within this)."""
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
