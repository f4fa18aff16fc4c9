"""Property tests of hashing, lookup and the batch framing: any token list, any block size
within the API's limits, any split of a prompt into store calls give the same ids and the same
match; any bytes given to the batch decoder give records or ``InvalidInput``, never another
exception."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessioncache.dataplane.frames.batch import MAGIC, decode_batch, encode_batch
from sessioncache.errors import InvalidInput
from sessioncache.hashing import (
    Namespace,
    block_hashes,
    block_hashes_from_bytes,
    namespace_root,
    tokens_to_le_bytes,
)
from sessioncache.store import TieredStore
from sessioncache.tiers.cpu import CpuTier

TOKEN = st.integers(min_value=0, max_value=(1 << 32) - 1)
EXAMPLES = int(os.environ.get("SESSIONCACHE_FUZZ_EXAMPLES", "40"))
"""Examples per property (CI: 40; more with ``SESSIONCACHE_FUZZ_EXAMPLES``)."""
PROFILE = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def namespace(block_tokens: int) -> Namespace:
    return Namespace("prop-model", block_tokens=block_tokens, kv_dtype="bf16", kv_layout="x")


@st.composite
def prompt_and_splits(draw: st.DrawFn) -> tuple[int, list[int], list[int]]:
    """A block size (1..64: the API allows up to 65,536, the property does not depend on it),
    a prompt, and cut points at block boundaries (a store call covers whole blocks)."""
    block_tokens = draw(st.integers(min_value=1, max_value=64))
    tokens = draw(st.lists(TOKEN, max_size=400))
    blocks = len(tokens) // block_tokens
    cuts = sorted(draw(st.sets(st.integers(min_value=0, max_value=blocks), max_size=6)))
    return block_tokens, tokens, cuts


@PROFILE
@given(prompt_and_splits())
def test_any_split_gives_the_same_ids(case: tuple[int, list[int], list[int]]) -> None:
    block_tokens, tokens, cuts = case
    ns = namespace(block_tokens)
    whole = block_hashes(ns, tokens)
    assert len(whole) == len(tokens) // block_tokens
    data = tokens_to_le_bytes(np.asarray(tokens, dtype=np.int64))
    step = block_tokens * 4
    parent = namespace_root(ns)
    pieced: list[bytes] = []
    start = 0
    for cut in [*cuts, len(whole)]:
        piece = block_hashes_from_bytes(parent, data[start * step : cut * step], block_tokens)
        pieced += piece
        if piece:
            parent = piece[-1]
        start = max(start, cut)
    assert pieced == whole
    # a prefix's ids are a prefix of the ids, and a partial tail gets none
    assert block_hashes(ns, tokens[: len(tokens) // 2]) == whole[: len(tokens) // 2 // block_tokens]


@PROFILE
@given(prompt_and_splits(), st.integers(min_value=0, max_value=10))
def test_any_split_of_stores_gives_the_same_match(
    case: tuple[int, list[int], list[int]], probe_extra: int
) -> None:
    block_tokens, tokens, cuts = case
    ns = namespace(block_tokens)
    ids = block_hashes(ns, tokens)
    store = TieredStore([CpuTier(64 << 20)])
    try:
        root = namespace_root(ns)
        start = 0
        for cut in [*cuts, len(ids)]:
            if cut > start:
                chunk = ids[start:cut]
                payloads = [
                    torch.full((16,), i % 251, dtype=torch.uint8) for i in range(start, cut)
                ]
                parent = ids[start - 1] if start else None
                store.writes.put(chunk, payloads, namespace_root=root, parent=parent)
                start = cut
        match = store.reads.lookup(ids)
        assert match.num_blocks == len(ids) and match.hashes == ids
        # a longer prompt with the same prefix matches exactly the stored blocks
        longer = block_hashes(ns, tokens + list(range(probe_extra * block_tokens)))
        assert store.reads.lookup(longer).num_blocks == len(ids)
        for i, h in enumerate(ids):
            assert store.reads.get_bytes(h) == bytes([i % 251]) * 16
    finally:
        store.close()


RECORDS = st.lists(
    st.tuples(st.binary(min_size=16, max_size=16), st.none() | st.binary(max_size=64)),
    max_size=8,
)


@PROFILE
@given(RECORDS)
def test_batch_framing_round_trips(records: list[tuple[bytes, bytes | None]]) -> None:
    assert decode_batch(b"".join(encode_batch(records))) == records


@settings(max_examples=EXAMPLES * 5, deadline=None)
@given(RECORDS, st.data())
def test_damaged_batches_are_invalid_input_or_records(
    records: list[tuple[bytes, bytes | None]], data: st.DataObject
) -> None:
    body = bytearray(b"".join(encode_batch(records)))
    action = data.draw(st.sampled_from(["truncate", "flip", "count", "append", "random"]))
    if action == "truncate" and body:
        del body[data.draw(st.integers(0, len(body) - 1)) :]
    elif action == "flip" and body:
        at = data.draw(st.integers(0, len(body) - 1))
        body[at] ^= data.draw(st.integers(1, 255))
    elif action == "count":
        struct.pack_into("<I", body, 4, data.draw(st.integers(0, (1 << 32) - 1)))
    elif action == "append":
        body += data.draw(st.binary(min_size=1, max_size=64))
    else:
        body = bytearray(MAGIC + data.draw(st.binary(max_size=128)))
    try:
        out = decode_batch(bytes(body))
    except InvalidInput as exc:
        assert str(exc)
        return
    for block_id, payload in out:
        assert len(block_id) == 16 and (payload is None or isinstance(payload, bytes))


def test_a_count_beyond_the_body_is_not_believed() -> None:
    # four billion records announced, none sent: an error, not a four-billion-step loop
    with pytest.raises(InvalidInput):
        decode_batch(MAGIC + struct.pack("<I", (1 << 32) - 1))
