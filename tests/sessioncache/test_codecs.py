"""Block codecs: lossless round trips are byte-exact, lossy ones bounded and opt-in through
the namespace (their ids are their own), the disk tier stores and reads each one, and the
node picks a namespace's codec from the namespace, its tenant or itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from sessioncache.codecs import (
    FP8_ID,
    INT8_ID,
    LOSSLESS_ID,
    RAW,
    CodecTable,
    decode_block,
    parse_codec,
)
from sessioncache.errors import InvalidInput
from sessioncache.hashing import BlockHash, Namespace
from sessioncache.tiers.base import PutItem, RecoveredBlock
from sessioncache.tiers.disk import HEADER_SIZE, DiskTier, decode_header

ROOT = b"R" * 16
OTHER = b"O" * 16
HEAD_DIM = 64


def kv_block(seed: int, nbytes: int = 64 * 1024) -> bytes:
    """bf16 values of a KV block's scale (smooth magnitudes, a few outliers)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(nbytes // 2, generator=gen) * 0.5
    x[::97] *= 8
    return bytes(x.to(torch.bfloat16).view(torch.uint8).numpy().tobytes())


def bid(i: int) -> BlockHash:
    return BlockHash(xxhash.xxh3_128_digest(f"codec-{i}".encode()))


def as_bf16(raw: bytes | np.ndarray) -> torch.Tensor:
    data = raw if isinstance(raw, bytes) else raw.tobytes()
    return torch.frombuffer(bytearray(data), dtype=torch.bfloat16).float()


# -- the codecs ----------------------------------------------------------------------------


@pytest.mark.parametrize("data", ["kv", "random", "zeros"])
def test_lossless_round_trips_are_byte_exact(data: str) -> None:
    raw = {
        "kv": kv_block(1),
        "random": np.random.default_rng(2).integers(0, 256, 50_001, dtype=np.uint8).tobytes(),
        "zeros": bytes(4096),
    }[data]
    codec = parse_codec("lossless", "bf16")
    stored = codec.encode(raw)
    assert codec.decode(stored, len(raw)).tobytes() == raw
    if data == "kv":
        assert len(raw) / stored.nbytes > 1.1  # bf16 exponents compress


@pytest.mark.parametrize(("name", "qmax"), [("int8", 127), ("fp8", 448)])
def test_lossy_codecs_halve_a_block_within_their_error(name: str, qmax: int) -> None:
    raw = kv_block(3)
    codec = parse_codec(f"{name}/{HEAD_DIM}", "bf16")
    assert codec.lossy and codec.name == f"{name}/{HEAD_DIM}"
    stored = codec.encode(raw)
    assert len(raw) / stored.nbytes > 1.9
    back = as_bf16(codec.decode(stored, len(raw)))
    x = as_bf16(raw)
    absmax = x.view(-1, HEAD_DIM).abs().amax(1, keepdim=True)
    err = (back - x).view(-1, HEAD_DIM).abs()
    bound = absmax / qmax if name == "int8" else absmax / 8  # e4m3: 3 mantissa bits
    assert bool((err <= bound * 0.51 + absmax * 2**-8).all())  # half a step, plus bf16's


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_a_group_holding_inf_or_nan_is_kept_exact_and_spoils_no_other(
    name: str, dtype: str
) -> None:
    torch_dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[dtype]
    x = torch.randn(64 * HEAD_DIM, generator=torch.Generator().manual_seed(9)).to(torch_dtype)
    x[3] = float("inf")  # group 0
    x[5 * HEAD_DIM + 7] = float("nan")  # group 5
    x[9 * HEAD_DIM] = float("-inf")  # group 9
    raw = x.view(torch.uint8).numpy().tobytes()
    codec = parse_codec(f"{name}/{HEAD_DIM}", dtype)
    stored = codec.encode(raw)
    assert stored.nbytes < len(raw)  # still coded: three groups of 64 kept exact
    back = torch.frombuffer(bytearray(codec.decode(stored, len(raw))), dtype=torch_dtype)
    rows, want = back.view(-1, HEAD_DIM), x.view(-1, HEAD_DIM)
    for g in (0, 5, 9):  # byte-exact, Inf and NaN included
        assert rows[g].view(torch.uint8).tolist() == want[g].view(torch.uint8).tolist()
    finite = [g for g in range(rows.shape[0]) if g not in (0, 5, 9)]
    assert bool(torch.isfinite(rows[finite]).all())
    err = (rows[finite].float() - want[finite].float()).abs().amax()
    assert float(err) < 0.5  # the other groups keep their codec's error


def test_bytes_a_codec_did_not_make_are_refused() -> None:
    raw = kv_block(4, 8192)
    for name in ("lossless", f"int8/{HEAD_DIM}", f"fp8/{HEAD_DIM}"):
        codec = parse_codec(name, "bf16")
        stored = bytearray(codec.encode(raw))
        with pytest.raises(InvalidInput):
            codec.decode(bytes(stored[: len(stored) // 2]), len(raw))
        with pytest.raises(InvalidInput):
            codec.decode(bytes(stored), len(raw) + 2 * HEAD_DIM)
    with pytest.raises(InvalidInput):
        decode_block(99, b"x", 1)


@pytest.mark.parametrize(
    ("text", "dtype"),
    [
        ("gzip", "bf16"),
        ("int8", "bf16"),
        ("int8/0", "bf16"),
        ("int8/x", "bf16"),
        ("int8/10000", "bf16"),
        ("int4/64", "bf16"),
        ("raw", "bf16"),  # unset says raw: one name, one id
        ("int8/064", "bf16"),
    ],
)
def test_a_codec_name_is_checked(text: str, dtype: str) -> None:
    with pytest.raises(InvalidInput):
        parse_codec(text, dtype)
    with pytest.raises(InvalidInput):
        Namespace("m", 16, dtype, "x", kv_codec=text)


def test_a_lossy_codec_on_kv_it_cannot_quantize_stores_it_raw() -> None:
    from sessioncache.codecs import encode_or_raw

    codec = parse_codec(f"fp8/{HEAD_DIM}", "u8")  # accepted: the engine's choice, exact here
    used, stored = encode_or_raw(codec, kv_block(14, 4096))
    assert used is RAW and bytes(stored) == kv_block(14, 4096)


def test_a_lossy_namespace_has_ids_of_its_own_and_others_keep_theirs() -> None:
    exact = Namespace("m", 16, "bf16", "x")
    lossy = Namespace("m", 16, "bf16", "x", kv_codec=f"int8/{HEAD_DIM}")
    assert lossy.root() != exact.root()
    assert "kv_codec" not in exact.as_json()  # unset: left out of the digest, ids unchanged
    assert lossy.as_json()["kv_codec"] == f"int8/{HEAD_DIM}"


def test_the_table_takes_the_namespace_then_the_tenant_then_the_node() -> None:
    table = CodecTable("raw", {"acme": "lossless"})
    exact = Namespace("m", 16, "bf16", "x")
    lossy = Namespace("m", 16, "bf16", "x", kv_codec=f"fp8/{HEAD_DIM}")
    assert table.remember(b"a" * 16, exact, "acme").id == LOSSLESS_ID
    assert table.remember(b"b" * 16, exact, "globex") is RAW
    assert table.remember(b"c" * 16, lossy, "globex").id == FP8_ID
    assert table.for_root(b"a" * 16).id == LOSSLESS_ID
    assert table.for_root(b"b" * 16) is RAW and table.for_root(b"z" * 16) is RAW
    with pytest.raises(InvalidInput):
        CodecTable("int8/64")  # a lossy codec is never a node's or tenant's choice
    with pytest.raises(InvalidInput):
        CodecTable("raw", {"acme": "fp8/64"})


# -- the disk tier -------------------------------------------------------------------------


def disk(path: Path) -> tuple[DiskTier, CodecTable]:
    table = CodecTable()
    table.remember(ROOT, Namespace("m", 16, "bf16", "x", kv_codec="lossless"), None)
    table.remember(OTHER, Namespace("m", 16, "bf16", "x", kv_codec=f"int8/{HEAD_DIM}"), None)
    return DiskTier.open(path, 16 << 20, codecs=table), table


def test_the_disk_tier_stores_each_namespace_with_its_codec(tmp_path: Path) -> None:
    tier, _ = disk(tmp_path)
    raw = kv_block(5)
    tier.put(PutItem(bid(1), raw, ROOT))  # lossless
    tier.put(PutItem(bid(2), raw, OTHER))  # int8
    tier.put(PutItem(bid(3), raw, b"P" * 16))  # a root never recorded: raw
    files = {i: (tmp_path / "blocks").rglob(f"{bid(i).hex()}.blk") for i in (1, 2, 3)}
    sizes = {i: next(f).stat().st_size - HEADER_SIZE for i, f in files.items()}
    assert sizes[3] == len(raw) and sizes[1] < len(raw) and sizes[2] < len(raw) * 0.52
    assert tier.used_bytes == sum(sizes.values())  # capacity counts stored bytes
    for i in (1, 2, 3):
        path = next((tmp_path / "blocks").rglob(f"{bid(i).hex()}.blk"))
        head = decode_header(path.read_bytes()[:HEADER_SIZE])
        assert head.codec == {1: LOSSLESS_ID, 2: INT8_ID, 3: 0}[i]
        assert head.raw_nbytes == len(raw) and head.nbytes == sizes[i]
    got = {i: tier.get(bid(i)) for i in (1, 2, 3)}
    assert bytes(got[1].numpy()) == raw and bytes(got[3].numpy()) == raw  # type: ignore[union-attr]
    lossy = as_bf16(got[2].numpy())  # type: ignore[union-attr]
    assert bytes(got[2].numpy()) != raw  # type: ignore[union-attr]
    assert (lossy - as_bf16(raw)).abs().max() < 0.1
    # a restart reads the headers: raw lengths for the store, stored ones for the capacity
    again = DiskTier.open(tmp_path, 16 << 20, codecs=CodecTable())
    found = {b.block_hash: b for b in again.recovered()}
    assert {b.nbytes for b in found.values()} == {len(raw)}
    assert again.used_bytes == tier.used_bytes
    assert bytes(again.get(bid(1)).numpy()) == raw  # type: ignore[union-attr]
    assert again.delete(bid(2)) == len(raw) and again.used_bytes == sizes[1] + sizes[3]


def test_a_damaged_stored_block_is_a_miss_and_quarantined(tmp_path: Path) -> None:
    tier, _ = disk(tmp_path)
    raw = kv_block(6)
    tier.put(PutItem(bid(7), raw, ROOT))
    path = next((tmp_path / "blocks").rglob(f"{bid(7).hex()}.blk"))
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 40] ^= 0x5A
    path.write_bytes(bytes(data))
    assert tier.get(bid(7)) is None
    assert not tier.contains(bid(7)) and list((tmp_path / "quarantine").iterdir())


def test_a_block_adopted_on_trust_is_read_whatever_its_codec(tmp_path: Path) -> None:
    tier, _ = disk(tmp_path)
    raw = kv_block(8)
    tier.put(PutItem(bid(9), raw, ROOT))
    restarted = DiskTier.open(tmp_path, 16 << 20, scan=False)  # the catalog's word only
    restarted.adopt([RecoveredBlock(bid(9), ROOT, len(raw), 0.0)])  # raw length, as the store
    assert restarted.used_bytes == len(raw)  # the catalog's word: its raw length
    assert bytes(restarted.get(bid(9)).numpy()) == raw  # type: ignore[union-attr]
    assert restarted.used_bytes == tier.used_bytes < len(raw)  # read once: what it stores
    assert restarted.stored_by_root() == tier.stored_by_root()


# -- the shared tier -----------------------------------------------------------------------


def test_the_redis_tier_stores_a_namespace_with_its_codec_and_any_node_reads_it() -> None:
    import os
    import secrets

    import redis

    from sessioncache.tiers.redis import _CODEC as redis_headers
    from sessioncache.tiers.redis import RedisTier

    url = os.environ.get("SESSIONCACHE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    prefix = f"sc-test-codec-{secrets.token_hex(4)}:"
    table = CodecTable()
    table.remember(ROOT, Namespace("m", 16, "bf16", "x", kv_codec="lossless"), None)
    table.remember(OTHER, Namespace("m", 16, "bf16", "x", kv_codec=f"int8/{HEAD_DIM}"), None)
    writer = RedisTier(lambda: redis.Redis.from_url(url), 16 << 20, prefix=prefix, codecs=table)
    reader = RedisTier(lambda: redis.Redis.from_url(url), 16 << 20, prefix=prefix)  # no table
    try:
        raw = kv_block(11)
        writer.put(PutItem(bid(21), raw, ROOT))
        writer.put(PutItem(bid(22), raw, OTHER))
        assert writer.used_bytes < 2 * len(raw)  # stored bytes are counted
        located = reader.locate_many([bid(21), bid(22)])
        assert [b.nbytes for b in located if b is not None] == [len(raw), len(raw)]  # raw
        got = reader.get_many([bid(21), bid(22)])
        assert bytes(got[0].numpy()) == raw  # type: ignore[union-attr]
        lossy = as_bf16(got[1].numpy())  # type: ignore[union-attr]
        assert (lossy - as_bf16(raw)).abs().max() < 0.1 and bytes(got[1].numpy()) != raw  # type: ignore[union-attr]
        # a newer node's codec (99): a miss here, the value left for the nodes that read it
        key, conn = reader.key(bid(21)), redis.Redis.from_url(url)
        value = bytearray(conn.get(key) or b"")
        head = redis_headers.decode(bytes(value[:HEADER_SIZE]))
        value[:HEADER_SIZE] = redis_headers.encode(
            bid(21), ROOT, None, head.nbytes, head.checksum, 99, head.raw_nbytes
        )
        conn.set(key, bytes(value))
        assert reader.get(bid(21)) is None
        assert conn.exists(key)
    finally:
        writer.clear_prefix()
        writer.close()
        reader.close()


def test_a_block_that_is_not_whole_groups_is_stored_raw(tmp_path: Path) -> None:
    tier, _ = disk(tmp_path)
    raw = kv_block(12, 64 * 1024 + 2)  # one bf16 element past whole groups of 64
    tier.put(PutItem(bid(30), raw, OTHER))  # an int8 namespace
    path = next((tmp_path / "blocks").rglob(f"{bid(30).hex()}.blk"))
    assert decode_header(path.read_bytes()[:HEADER_SIZE]).codec == 0
    assert bytes(tier.get(bid(30)).numpy()) == raw  # type: ignore[union-attr]


def test_a_coded_header_is_version_2_so_readers_before_codecs_refuse_it(tmp_path: Path) -> None:
    tier, _ = disk(tmp_path)
    raw, noise = kv_block(13), np.random.default_rng(5).integers(0, 256, 4096, np.uint8)
    tier.put(PutItem(bid(40), raw, ROOT))
    tier.put(PutItem(bid(41), noise.tobytes(), ROOT))  # incompressible: stored raw, exact
    for i, version, codec in ((40, 2, LOSSLESS_ID), (41, 1, 0)):
        data = next((tmp_path / "blocks").rglob(f"{bid(i).hex()}.blk")).read_bytes()
        assert int.from_bytes(data[8:10], "little") == version
        assert decode_header(data[:HEADER_SIZE]).codec == codec
    assert bytes(tier.get(bid(41)).numpy()) == noise.tobytes()  # type: ignore[union-attr]


def test_a_hybrid_state_group_is_never_quantized() -> None:
    from sessioncache.connector.hybrid import GroupSpec, HybridModel

    model = HybridModel(
        GroupSpec("full", ("l0", "l3")),
        (GroupSpec("state", ("l1", "l2")), GroupSpec("window", ("l4",), 2)),
    )
    base = Namespace("m", 16, "bf16", "x", kv_codec=f"int8/{HEAD_DIM}")
    spine, (state, window) = model.namespaces(base)
    assert spine.kv_codec == window.kv_codec == f"int8/{HEAD_DIM}" and state.kv_codec is None
