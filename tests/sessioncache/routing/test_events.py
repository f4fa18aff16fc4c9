"""Both encodings of vLLM's KV events decode to the same events; unknown trailing fields and
event types are skipped; anything else is refused with a message."""

from __future__ import annotations

import msgspec
import pytest

from sessioncache.routing.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    decode_batch,
    encode_seq,
    split_published,
    split_replayed,
)
from tests.support import vllm_events as ve

TOKENS = list(range(32))


@pytest.mark.parametrize("legacy", [True, False], ids=["vllm<=0.23", "vllm>=0.24"])
def test_both_encodings_decode_alike(legacy: bool):
    events = [
        ve.stored(legacy, [11, 12], None, TOKENS, 16, medium="GPU", lora_id=3, lora_name="a"),
        ve.stored(legacy, [13], 12, TOKENS[:16], 16, medium=None),
        ve.removed(legacy, [12], "CPU"),
        ve.cleared(legacy),
    ]
    batch = decode_batch(msgspec.msgpack.encode(ve.batch(legacy, events)))
    assert batch.data_parallel_rank == 0
    assert batch.events == [
        BlockStored([11, 12], None, TOKENS, 16, 3, "GPU", "a"),
        BlockStored([13], 12, TOKENS[:16], 16, None, "GPU", None),
        BlockRemoved([12], "CPU"),
        AllBlocksCleared(),
    ]


def test_extra_keys_are_kept_new_fields_and_event_types_skipped():
    event = ve.BlockStored(
        [b"\x01" * 32], None, TOKENS[:16], 16, None, "GPU", None,
        extra_keys=[("mm", 1)], group_idx=0, kv_cache_spec_kind="full",
    )  # fmt: skip
    raw = msgspec.msgpack.encode(ve.batch(False, [event, ve.SomethingNew("x")]))
    batch = decode_batch(raw)
    assert batch.unknown == 1
    assert batch.events == [
        BlockStored([b"\x01" * 32], None, TOKENS[:16], 16, None, "GPU", None, 0, [["mm", 1]])
    ]
    # a positional event with fields appended by a later version
    legacy = [0.0, [["BlockStored", [1], None, TOKENS[:16], 16, None, "CPU", None, None, 2, 9]]]
    assert decode_batch(msgspec.msgpack.encode(legacy)).events == [
        BlockStored([1], None, TOKENS[:16], 16, None, "CPU", None, 2)
    ]
    # the batch as a map (recent vLLM main) decodes too
    as_map = {"ts": 1.0, "events": [{"type": "AllBlocksCleared"}]}
    assert decode_batch(msgspec.msgpack.encode(as_map)).events == [AllBlocksCleared()]


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        msgspec.msgpack.encode(7),
        msgspec.msgpack.encode([0.0]),
        msgspec.msgpack.encode([0.0, [5]]),
        msgspec.msgpack.encode([0.0, [["BlockStored", "x", None, [1], 16, None]]]),
        msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, [1], 0, None]]]),
        msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}]]),
    ],
)
def test_malformed_payloads_are_refused(payload: bytes):
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


def test_frames():
    assert split_published([b"t", encode_seq(5), b"p"]) == (b"t", 5, b"p")
    assert split_replayed([b"", encode_seq(5), b"p"]) == (5, b"p")
    assert split_replayed([b"", b"topic", encode_seq(6), b"p"]) == (6, b"p")
    assert split_replayed([b"", encode_seq(-1), b""]) == (-1, b"")
    with pytest.raises(EventDecodeError):
        split_published([b"t", b"123", b"p"])
    with pytest.raises(EventDecodeError):
        split_replayed([b"", b"a", b"b", b"c", b"d"])
