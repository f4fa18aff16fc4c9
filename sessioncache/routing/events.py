"""vLLM's KV cache events, decoded without I/O.

vLLM (``vllm/distributed/kv_events.py``) publishes msgpack ``EventBatch`` payloads: a batch is
``[ts, events, data_parallel_rank]`` (positional; a map ``{"ts", "events", ...}`` is accepted
too), and each event is one of two encodings seen in the wild:

- up to vLLM 0.23, ``array_like`` tagged structs: ``["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, ...]``;
- from 0.24, maps with a ``"type"`` tag: ``{"type": "BlockStored", "block_hashes": ...}``.

Both drop trailing fields left at their default (``omit_defaults``); fields added by later
versions are ignored, and so are event types this module does not know. Block hashes are the
engine's own (64-bit ints, or bytes in some versions): they are kept only as keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from sessioncache.errors import EventDecodeError

EngineHash = int | bytes
"""A block hash as the engine reports it (an int, or bytes): a key, never a sessioncache id."""

GPU, CPU, STORAGE = "GPU", "CPU", "STORAGE"
MEDIA = (GPU, CPU, STORAGE)
"""The media vLLM reports; a missing or None medium is the GPU (vLLM's ``MEDIUM_GPU``)."""

END_SEQ = -1
"""The sequence number ending a replay."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str = GPU
    lora_name: str | None = None
    group_idx: int | None = None
    extra_keys: list[Any] | None = None
    """Per block, the extra keys of the engine's hash as the engine sent them (vLLM: the
    LoRA, multimodal ids, the request's ``cache_salt`` in the first block of a chain)."""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[EngineHash]
    medium: str = GPU
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None
    unknown: int = 0
    """Events of a type this module does not know (skipped)."""


_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")

_decoder = msgspec.msgpack.Decoder()
_HASH_TYPES = {int, bytes}


def _hashes(value: Any, what: str) -> list[EngineHash]:
    if not isinstance(value, list):
        raise EventDecodeError(f"{what}: block_hashes is not a list")
    if not set(map(type, value)) <= _HASH_TYPES:  # at C speed: thousands of hashes a batch
        raise EventDecodeError(f"{what}: a block hash is neither an int nor bytes")
    return value


def _medium(value: Any) -> str:
    if value is None:
        return GPU
    if not isinstance(value, str):
        raise EventDecodeError("medium is not a string")
    return value.upper()


def _opt_int(value: Any, name: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise EventDecodeError(f"{name} is not an int")


def _fields(raw: Any, names: Sequence[str]) -> tuple[str, dict[str, Any]] | None:
    """``(type, fields)`` of one encoded event in either encoding; None for a shape that is
    neither (the caller rejects it)."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        return raw[0], dict(zip(names, raw[1:], strict=False))
    if isinstance(raw, dict) and isinstance(raw.get("type"), str):
        return raw["type"], raw
    return None


def decode_event(raw: Any) -> Event | None:
    """One event in either encoding; None for an event type this module does not know."""
    tagged = _fields(raw, _STORED_FIELDS)
    if tagged is None:
        raise EventDecodeError("an event is neither a tagged array nor a map with a 'type'")
    kind, f = tagged
    if kind == "BlockStored":
        tokens = f.get("token_ids")
        size = f.get("block_size")
        if not isinstance(tokens, list) or not isinstance(size, int) or size <= 0:
            raise EventDecodeError("BlockStored: token_ids or block_size is missing or malformed")
        parent = f.get("parent_block_hash")
        if parent is not None and (not isinstance(parent, int | bytes) or isinstance(parent, bool)):
            raise EventDecodeError("BlockStored: parent_block_hash is neither an int nor bytes")
        lora_name = f.get("lora_name")
        if lora_name is not None and not isinstance(lora_name, str):
            raise EventDecodeError("BlockStored: lora_name is not a string")
        extra_keys = f.get("extra_keys")
        if extra_keys is not None and not isinstance(extra_keys, list):
            raise EventDecodeError("BlockStored: extra_keys is not a list")
        return BlockStored(
            _hashes(f.get("block_hashes"), "BlockStored"),
            parent,
            tokens,
            size,
            _opt_int(f.get("lora_id"), "lora_id"),
            _medium(f.get("medium")),
            lora_name,
            _opt_int(f.get("group_idx"), "group_idx"),
            extra_keys,
        )
    if kind == "BlockRemoved":
        if isinstance(raw, list):
            f = dict(zip(_REMOVED_FIELDS, raw[1:], strict=False))
        return BlockRemoved(
            _hashes(f.get("block_hashes"), "BlockRemoved"),
            _medium(f.get("medium")),
            _opt_int(f.get("group_idx"), "group_idx"),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(payload: bytes) -> EventBatch:
    """One published payload; ``EventDecodeError`` when it is not an event batch."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"not msgpack: {exc}") from None
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict) and "events" in raw:
        ts, events, rank = raw.get("ts", 0.0), raw["events"], raw.get("data_parallel_rank")
    else:
        raise EventDecodeError("not an EventBatch: expected [ts, events, data_parallel_rank]")
    if not isinstance(events, list) or not isinstance(ts, int | float):
        raise EventDecodeError("not an EventBatch: ts or events is malformed")
    out: list[Event] = []
    unknown = 0
    for item in events:
        event = decode_event(item)
        if event is None:
            unknown += 1
        else:
            out.append(event)
    return EventBatch(float(ts), out, _opt_int(rank, "data_parallel_rank"), unknown)


def decode_seq(raw: bytes) -> int:
    """An 8-byte big-endian sequence number (signed: the replay's end marker is -1)."""
    if len(raw) != 8:
        raise EventDecodeError(f"a sequence number is 8 bytes, got {len(raw)}")
    return int.from_bytes(raw, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def split_published(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` of one message from the PUB socket."""
    if len(frames) != 3:
        raise EventDecodeError(f"a published message has 3 frames, got {len(frames)}")
    return frames[0], decode_seq(frames[1]), frames[2]


def split_replayed(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """``(seq, payload)`` of one replay answer, as a DEALER receives it: an empty delimiter,
    then ``(seq, payload)`` (vLLM up to 0.24) or ``(topic, seq, payload)`` (later)."""
    parts = list(frames)
    if parts and parts[0] == b"":
        parts = parts[1:]
    if len(parts) == 2:
        return decode_seq(parts[0]), parts[1]
    if len(parts) == 3:
        return decode_seq(parts[1]), parts[2]
    raise EventDecodeError(f"a replay answer has 2 or 3 frames, got {len(parts)}")
