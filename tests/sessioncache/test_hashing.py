"""Block ids: the exact spec of docs/hashing.md, golden vectors, and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from sessioncache import Namespace as TopLevelNamespace
from sessioncache.catalog.reconcile import checksum_of
from sessioncache.dataplane.slots import copy_and_hash
from sessioncache.errors import InvalidInput
from sessioncache.hashing import (
    BlockHash,
    Namespace,
    block_hashes,
    block_key,
    from_hex,
    keyed_block_ids,
    namespace_root,
    payload_checksum,
    payload_hasher,
    segment_ids,
    to_hex,
)
from sessioncache.tiers.base import PutItem
from sessioncache.tiers.disk import HEADERS, DiskTier

LLAMA = Namespace("meta-llama/Llama-3.1-8B-Instruct", 16, "bfloat16", "vllm-nhd-v1")
QWEN = Namespace(
    "Qwen/Qwen3-32B", 4, "float16", "hf-dynamic-cache", salt="acme/team-1", lora="adapter-7"
)

# The same vectors stand in docs/hashing.md; other implementations check themselves against them.
GOLDEN = [
    (
        LLAMA,
        list(range(40)),
        0,
        "4fd5a33410434ebc838f93529b4d8158",
        ["978094f41daae8306d3c953a61392c71", "3721f159b3de51720a8cc06394775b9d"],
    ),
    (
        Namespace(
            "meta-llama/Llama-3.1-8B-Instruct", 16, "bfloat16", "vllm-nhd-v1", salt="tenant-a"
        ),
        list(range(40)),
        0,
        "5df9933145b78317e5408fcd2b6eb784",
        ["c99c5793a15b2bad254cc28b93566543", "ea3591e4aac2d131184bbb21f86b83a1"],
    ),
    (
        QWEN,
        [0, 1, 2**32 - 1, 7, 100000, 5, 6, 8, 9],
        42,
        "fbb67e74190efafffc8edc8a492d926d",
        ["74439fc9d76212a2d0746500b91b7d4d", "682fecf8404e240bbfdc6cddd02b94ef"],
    ),
]


def reference_ids(
    ns: Namespace, tokens: list[int], seed: int, extra: dict[str, str] | None = None
) -> tuple[bytes, list[bytes]]:
    """The spec written out with nothing but json, struct-free numpy and xxhash (``extra``:
    the later fields that are set)."""
    canonical = json.dumps(
        {
            "block_tokens": ns.block_tokens,
            "kv_dtype": ns.kv_dtype,
            "kv_layout": ns.kv_layout,
            "lora": ns.lora,
            "model": ns.model,
            "salt": ns.salt,
            **(extra or {}),
        },
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
    ).encode()
    root = xxhash.xxh3_128_digest(b"sessioncache-ns-v1\x00" + canonical, seed)
    out, parent = [], root
    for i in range(len(tokens) // ns.block_tokens):
        block = np.asarray(tokens[i * ns.block_tokens : (i + 1) * ns.block_tokens], dtype="<u4")
        parent = xxhash.xxh3_128_digest(parent + block.tobytes(), seed)
        out.append(parent)
    return root, out


@pytest.mark.parametrize(("ns", "tokens", "seed", "root", "ids"), GOLDEN)
def test_golden_vectors(ns: Namespace, tokens: list[int], seed: int, root: str, ids: list[str]):
    assert namespace_root(ns, seed).hex() == root
    assert [to_hex(h) for h in block_hashes(ns, tokens, seed)] == ids
    ref_root, ref_ids = reference_ids(ns, tokens, seed)
    assert ref_root.hex() == root
    assert [h.hex() for h in ref_ids] == ids


def test_namespace_importable_from_package_root():
    assert TopLevelNamespace is Namespace


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    block_tokens=st.integers(1, 33),
    seed=st.integers(0, 2**64 - 1),
)
def test_matches_reference_for_any_input(tokens: list[int], block_tokens: int, seed: int):
    ns = Namespace("m", block_tokens, "fp8", "layout", salt="s")
    _, ref = reference_ids(ns, tokens, seed)
    assert block_hashes(ns, tokens, seed) == ref


@pytest.mark.parametrize("dtype", ["<u4", ">u4", "int64", "uint16", "int32"])
def test_numpy_input_of_any_integer_dtype_equals_list_input(dtype: str):
    tokens = list(range(0, 3000, 7))
    assert block_hashes(LLAMA, np.asarray(tokens, dtype=dtype)) == block_hashes(LLAMA, tokens)


def test_only_full_blocks_get_ids_and_equal_prefixes_share_ids():
    a = block_hashes(LLAMA, list(range(47)))
    b = block_hashes(LLAMA, [*range(32), 999, 998])
    assert len(a) == 2 and len(b) == 2
    assert a[0] == b[0] and a[1] == b[1]
    c = block_hashes(LLAMA, [*range(16), 5, *range(17, 32)])
    assert c[0] == a[0] and c[1] != a[1]
    assert block_hashes(LLAMA, list(range(15))) == []


def test_every_namespace_field_and_the_seed_change_the_chain():
    tokens = list(range(16))
    base = block_hashes(LLAMA, tokens)[0]
    variants = [
        Namespace("other", 16, "bfloat16", "vllm-nhd-v1"),
        Namespace(LLAMA.model, 16, "float16", "vllm-nhd-v1"),
        Namespace(LLAMA.model, 16, "bfloat16", "other"),
        Namespace(LLAMA.model, 16, "bfloat16", "vllm-nhd-v1", salt="t"),
        Namespace(LLAMA.model, 16, "bfloat16", "vllm-nhd-v1", lora="l"),
        Namespace(LLAMA.model, 16, "bfloat16", "vllm-nhd-v1", group="window-256/l0"),
    ]
    ids = {block_hashes(ns, tokens)[0] for ns in variants}
    ids.add(block_hashes(LLAMA, tokens, seed=1)[0])
    assert base not in ids and len(ids) == len(variants) + 1


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["a"], [[1, 2]]])
def test_token_ids_outside_uint32_raise_value_error(bad: list[object]):
    with pytest.raises(ValueError):
        block_hashes(LLAMA, bad)  # type: ignore[arg-type]


def test_bad_numpy_tokens_raise():
    with pytest.raises(ValueError):
        block_hashes(LLAMA, np.array([-5, 3], dtype=np.int64))
    with pytest.raises(ValueError):
        block_hashes(LLAMA, np.zeros((2, 16), dtype=np.uint32))
    with pytest.raises(ValueError):
        block_hashes(LLAMA, np.zeros(16, dtype=np.float32))


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_seed_must_be_unsigned_64_bit(seed: int):
    with pytest.raises(ValueError):
        block_hashes(LLAMA, list(range(16)), seed=seed)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_tokens": 0},
        {"block_tokens": -16},
        {"block_tokens": True},
        {"model": ""},
        {"salt": 5},
    ],
)
def test_bad_namespace_raises(kwargs: dict[str, object]):
    fields: dict[str, object] = {
        "model": "m",
        "block_tokens": 16,
        "kv_dtype": "bf16",
        "kv_layout": "x",
    }
    fields.update(kwargs)
    with pytest.raises(InvalidInput):
        Namespace(**fields)  # type: ignore[arg-type]


def test_hex_round_trip_and_bad_hex():
    h = block_hashes(LLAMA, list(range(16)))[0]
    assert from_hex(to_hex(h)) == h and to_hex(h) == to_hex(h).lower()
    for bad in ["", "zz" * 16, "ab" * 15, "AB" * 17]:
        with pytest.raises(InvalidInput):
            from_hex(bad)


def test_an_unset_later_field_is_left_out_of_the_digest():
    """``group`` came after the first version: unset, the encoding (and every id) is the first
    version's; set, it enters the encoding like any other field."""
    assert LLAMA.group is None
    assert b"group" not in LLAMA.canonical_json()
    assert "group" not in LLAMA.as_json()
    grouped = Namespace(LLAMA.model, 16, "bfloat16", "vllm-nhd-v1", group="state/l0.l1")
    body = json.loads(grouped.canonical_json())
    assert body["group"] == "state/l0.l1" and body["salt"] is None  # first-version nulls stay
    ref_root, ref_ids = reference_ids(grouped, list(range(32)), 0, extra={"group": "state/l0.l1"})
    assert grouped.root() == ref_root
    assert block_hashes(grouped, list(range(32))) == ref_ids
    assert Namespace(**grouped.as_json()) == grouped and Namespace(**LLAMA.as_json()) == LLAMA


def test_related_namespaces_differ_in_their_group_only():
    full = Namespace("m", 16, "bfloat16", "l", salt="t", group="full/l5")
    window = Namespace("m", 16, "bfloat16", "l", salt="t", group="window-256/l0")
    assert full.related(window) and window.related(full)
    assert not full.related(Namespace("m", 16, "bfloat16", "l", salt="t"))  # no group
    assert not full.related(Namespace("m", 16, "bfloat16", "l", salt="u", group="window/l0"))
    assert not full.related(Namespace("m", 32, "bfloat16", "l", salt="t", group="window/l0"))


def test_payload_checksum_is_xxh3_64_seed_0_whole_or_in_pieces():
    data = np.random.default_rng(7).integers(0, 256, 3 * 1000 + 17, np.uint8)
    expected = xxhash.xxh3_64_intdigest(data.tobytes())
    assert payload_checksum(data.tobytes()) == expected
    assert payload_checksum(memoryview(data)) == expected
    assert payload_checksum(data.data) == expected
    hasher = payload_hasher()
    for start in range(0, data.nbytes, 1000):
        hasher.update(data[start : start + 1000].data)
    assert hasher.intdigest() == expected
    assert copy_and_hash(np.empty_like(data), data) == expected  # the same-host slots' copy


def test_every_layer_writes_the_same_payload_checksum(tmp_path):
    payload = np.arange(4096, dtype=np.uint8)
    tier = DiskTier.open(tmp_path / "blocks", 1 << 20)
    try:
        block = bytes(range(16))
        tier.put(PutItem(BlockHash(block), payload, bytes(16), None, float("inf")))
        header = HEADERS.decode((tmp_path / "blocks").rglob("*.blk").__next__().read_bytes())
    finally:
        tier.close()
    assert header.checksum == payload_checksum(payload.data)
    assert checksum_of(torch.from_numpy(payload)) == payload_checksum(payload).to_bytes(8, "big")


def test_segment_ids_chain_from_the_parent_or_the_root_and_key_from_the_root():
    root = LLAMA.root()
    tokens = list(range(48))
    units = np.asarray(tokens, "<u4").tobytes()
    chain = block_hashes(LLAMA, tokens)
    assert segment_ids(root, None, units, 16) == chain
    assert segment_ids(root, chain[0], units[16 * 4 :], 16) == chain[1:]
    assert segment_ids(root, chain[1], units[16 * 4 :], 16, seed=0) != chain[1:]
    keys = [block_key("a"), block_key("b")]
    keyed = segment_ids(root, chain[0], b"".join(keys), 16, keyed=True, seed=3)
    assert keyed == keyed_block_ids(root, keys, 3)  # the parent takes no part in a key's id
