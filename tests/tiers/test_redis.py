"""The Redis tier against real servers: expiry, verification, batches, headers-only lookups,
sharing between nodes, and degradation while a redis-server this test owns is killed."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import redis
import torch

from sessioncache.errors import InvalidInput, PayloadSizeError, TierFull
from sessioncache.hashing import BlockHash
from sessioncache.redis_link import (
    REDIS_URL_ENV,
    TierUnavailable,
    client_factory,
    make_client,
)
from sessioncache.redis_link import sends_parts as _sends_parts
from sessioncache.tiers.base import CheckedTier, PutItem, Tier
from sessioncache.tiers.redis import HEADER_SIZE, RedisTier, encode_header

URL = os.environ.get("SESSIONCACHE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
NS = b"\x07" * 16


def _support() -> ModuleType:
    name = "sessioncache_tests_redis_support"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "support" / "redis_cluster.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def bid(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def payload(i: int, size: int = 256) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def as_bytes(t: torch.Tensor | None) -> bytes:
    assert t is not None
    return bytes(t.numpy().tobytes())


@pytest.fixture
def raw() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(URL)
    yield client
    client.close()


@pytest.fixture
def prefix(raw: redis.Redis) -> Iterator[str]:
    """A key prefix of this test alone; whatever is left under it is deleted afterwards."""
    value = f"sctest:{uuid.uuid4().hex}:"
    yield value
    keys = list(raw.scan_iter(match=value + "*", count=1000))
    if keys:
        raw.unlink(*keys)


@pytest.fixture
def tier(prefix: str) -> Iterator[RedisTier]:
    made = RedisTier(lambda: make_client(URL), 1 << 30, prefix=prefix, owns_keys=True)
    yield made
    made.close()


def test_protocols(tier: RedisTier) -> None:
    assert isinstance(tier, Tier) and isinstance(tier, CheckedTier)
    assert tier.problem() is None and not tier.durable


def test_value_is_header_then_payload_with_expiry_from_pxat(
    tier: RedisTier, raw: redis.Redis
) -> None:
    data = bytes(range(256)) * 4 + b"\r\n\x00$*"  # binary-safe: protocol bytes included
    expires = time.time() + 1234.5
    tier.put(PutItem(bid(1), data, NS, parent=bid(0), expires_at=expires))
    value = raw.get(tier.key(bid(1)))
    assert isinstance(value, bytes) and len(value) == HEADER_SIZE + len(data)
    assert value[HEADER_SIZE:] == data
    assert value[16:32] == bid(1) and value[32:48] == NS and value[48:64] == bid(0)
    pttl = raw.pttl(tier.key(bid(1)))
    assert abs(pttl / 1000 - 1234.5) < 2
    assert as_bytes(tier.get(bid(1))) == data


def test_default_ttl_and_set_expiry_only_raises(prefix: str, raw: redis.Redis) -> None:
    tier = RedisTier(make_client(URL), 1 << 20, prefix=prefix, default_ttl_s=600)
    try:
        tier.put(PutItem(bid(1), payload(1), NS))
        assert 598_000 < raw.pttl(tier.key(bid(1))) <= 600_000
        tier.set_expiry(bid(1), time.time() + 3600)
        assert 3_598_000 < raw.pttl(tier.key(bid(1))) <= 3_600_000
        tier.set_expiry(bid(1), time.time() + 60)  # GT: another node wants it longer
        assert raw.pttl(tier.key(bid(1))) > 3_590_000
        tier.set_expiry_many([(bid(1), time.time() + 7200), (bid(2), time.time() + 7200)])
        assert raw.pttl(tier.key(bid(1))) > 7_190_000 and raw.exists(tier.key(bid(2))) == 0
    finally:
        tier.close()


def test_expired_blocks_leave_redis_and_the_accounting(tier: RedisTier) -> None:
    tier.put(PutItem(bid(1), payload(1), NS, expires_at=time.time() + 1.0))  # the shortest allowed
    tier.put(PutItem(bid(2), payload(2), NS))
    assert tier.used_bytes == 512
    time.sleep(1.1)
    assert tier.get(bid(1)) is None and not tier.contains(bid(1))
    assert tier.used_bytes == 256 and tier.fits((1 << 30) - 256)


@pytest.mark.parametrize(
    "damage",
    ["payload-bit", "truncated", "header-bit", "other-id", "wrong-type", "garbage"],
)
def test_corrupt_value_is_a_miss_and_is_deleted(
    tier: RedisTier, raw: redis.Redis, damage: str
) -> None:
    tier.put(PutItem(bid(1), payload(1), NS))
    tier.put(PutItem(bid(2), payload(2), NS))
    key = tier.key(bid(1))
    value = raw.get(key)
    assert isinstance(value, bytes)
    if damage == "payload-bit":
        raw.setrange(key, HEADER_SIZE + 100, bytes([value[HEADER_SIZE + 100] ^ 1]))
    elif damage == "truncated":
        raw.set(key, value[:-1])
    elif damage == "header-bit":
        raw.setrange(key, 60, bytes([value[60] ^ 0x80]))
    elif damage == "other-id":
        other = raw.get(tier.key(bid(2)))
        assert isinstance(other, bytes)
        raw.set(key, other)  # a valid block, but not this one
    elif damage == "wrong-type":
        raw.delete(key)
        raw.rpush(key, b"x")
    else:
        raw.set(key, b"not a block")
    assert tier.get(bid(1)) is None
    assert raw.exists(key) == 0
    assert tier.counters().corrupt == 1
    assert as_bytes(tier.get(bid(2))) == payload(2)  # the neighbour is untouched
    tier.put(PutItem(bid(1), payload(1), NS))  # and the block can be stored again
    assert as_bytes(tier.get(bid(1))) == payload(1)


def test_batches(tier: RedisTier) -> None:
    items = [PutItem(bid(i), payload(i, 1000), NS, bid(i - 1) if i else None) for i in range(40)]
    assert tier.put_many(items[:10]) == [True] * 10
    # held ones are skipped; a duplicate inside the batch is written once
    again = [*items, items[20]]
    assert tier.put_many(again) == [False] * 10 + [True] * 30 + [False]
    assert tier.used_bytes == 40 * 1000
    got = tier.get_many([bid(i) for i in range(45)])
    assert [as_bytes(g) for g in got[:40]] == [payload(i, 1000) for i in range(40)]
    assert got[40:] == [None] * 5
    assert tier.delete_many([bid(0), bid(0), bid(99)]) == [1000, 0, 0]
    assert tier.get_many([]) == [] and tier.put_many([]) == []


def test_small_max_batch_bytes_splits_pipelines(prefix: str) -> None:
    tier = RedisTier(make_client(URL), 1 << 20, prefix=prefix, max_batch_bytes=3000)
    try:
        flags = tier.put_many([PutItem(bid(i), payload(i, 1000), NS) for i in range(10)])
        assert flags == [True] * 10
        assert [as_bytes(g) for g in tier.get_many([bid(i) for i in range(10)])] == [
            payload(i, 1000) for i in range(10)
        ]
    finally:
        tier.close()


def test_batch_is_validated_and_reserved_before_anything_is_written(tier: RedisTier) -> None:
    small = RedisTier(make_client(URL), 2048, prefix=tier.prefix)
    try:
        with pytest.raises(TierFull):
            small.put_many([PutItem(bid(i), payload(i, 1000), NS) for i in range(3)])
        with pytest.raises(PayloadSizeError):
            small.put_many([PutItem(bid(1), payload(1), NS), PutItem(bid(2), b"", NS)])
        with pytest.raises(InvalidInput):
            small.put_many([PutItem(bid(1), payload(1), b"short")])
        with pytest.raises(InvalidInput):
            small.put(PutItem(bid(1), payload(1), NS, parent=BlockHash(b"x")))
        assert small.keys() == [] and small.used_bytes == 0
    finally:
        small.close()


def test_plain_redis_py_client_works_by_copying(prefix: str) -> None:
    """A client not made by make_client cannot send a value in parts: the tier copies header
    and payload into pooled buffers instead, with the same result."""
    client = redis.Redis.from_url(URL)
    assert not _sends_parts(client) and _sends_parts(make_client(URL))
    tier = RedisTier(client, 1 << 20, prefix=prefix, buffer_pool_bytes=4096)
    try:
        items = [PutItem(bid(i), payload(i, 1000), NS) for i in range(5)]
        assert tier.put_many(items) == [True] * 5
        tier.put(PutItem(bid(9), np.frombuffer(payload(9, 1000), dtype=np.float16), NS))
        got = tier.get_many([bid(i) for i in [*range(5), 9]])
        assert [as_bytes(g) for g in got] == [payload(i, 1000) for i in [*range(5), 9]]
    finally:
        tier.close()
        client.close()


def test_locate_many_reads_headers_only(tier: RedisTier) -> None:
    expires = time.time() + 5000
    tier.put(PutItem(bid(1), payload(1, 4096), NS, expires_at=expires))
    tier.put(PutItem(bid(2), payload(2, 4096), NS, parent=bid(1)))
    found = tier.locate_many([bid(1), bid(2), bid(3)])
    first, second, missing = found
    assert missing is None
    assert first is not None and second is not None
    assert (first.block_hash, first.namespace_root, first.parent, first.nbytes) == (
        bid(1),
        NS,
        None,
        4096,
    )
    assert first.expires_at is not None and abs(first.expires_at - expires) < 0.01
    assert second.parent == bid(1) and second.nbytes == 4096
    assert tier.locate_many([]) == []


def test_two_nodes_share_blocks(prefix: str, raw: redis.Redis) -> None:
    a = RedisTier(make_client(URL), 1 << 20, prefix=prefix)
    b = RedisTier(make_client(URL), 1 << 20, prefix=prefix)
    try:
        a.put(PutItem(bid(1), payload(1), NS, expires_at=time.time() + 100))
        assert as_bytes(b.get(bid(1))) == payload(1) and b.contains(bid(1))
        # b's put of a block a wrote sends no payload, but keeps it alive as long as b wants
        b.put(PutItem(bid(1), payload(1), NS, expires_at=time.time() + 500))
        assert b.used_bytes == 0 and a.used_bytes == 256
        assert raw.pttl(a.key(bid(1))) > 490_000
        assert b.keys() == [bid(1)]
        # what a node accounts is what it wrote: b deleting a's block frees it in Redis
        assert b.delete(bid(1)) == 256 and a.get(bid(1)) is None
    finally:
        a.close()
        b.close()


def test_close_deletes_only_with_owns_keys(prefix: str, raw: redis.Redis) -> None:
    keep = RedisTier(make_client(URL), 1 << 20, prefix=prefix + "keep:")
    keep.put(PutItem(bid(1), payload(1), NS))
    keep.close()
    assert raw.exists(f"{prefix}keep:b:{bid(1).hex()}") == 1
    owned = RedisTier(make_client(URL), 1 << 20, prefix=prefix + "own:", owns_keys=True)
    owned.put(PutItem(bid(1), payload(1), NS))
    owned.close()
    assert raw.exists(f"{prefix}own:b:{bid(1).hex()}") == 0
    assert raw.ping()  # the client handed in belongs to the caller, the database is intact


def test_glob_characters_in_prefix_stay_literal(prefix: str) -> None:
    tier = RedisTier(make_client(URL), 1 << 20, prefix=prefix + "[x]*?:", owns_keys=True)
    other = RedisTier(make_client(URL), 1 << 20, prefix=prefix + "x:")
    try:
        tier.put(PutItem(bid(1), payload(1), NS))
        other.put(PutItem(bid(2), payload(2), NS))
        assert tier.keys() == [bid(1)]
    finally:
        tier.close()
        assert other.keys() == [bid(2)]
        other.close()


def test_header_encoding_is_stable() -> None:
    header = encode_header(bid(1), NS, None, 5, 0x1234)
    assert len(header) == HEADER_SIZE and header[:8] == b"SCRBLK\x00\x01"
    assert header[48:64] == b"\x00" * 16


def test_make_client_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REDIS_URL_ENV, URL)
    client = make_client()
    try:
        assert client.ping()
    finally:
        client.close()
    monkeypatch.delenv(REDIS_URL_ENV)
    with pytest.raises(InvalidInput):
        make_client()


# -- degradation --------------------------------------------------------------------------


def test_server_down_at_start_then_up(tmp_path: Path) -> None:
    """A node starts while Redis is down, serves misses, and connects when it comes up."""
    support = _support()
    server = support.RedisServer(tmp_path / "redis")
    tier = RedisTier(client_factory(server.url), 1 << 20, prefix="sctest:", probe_interval_s=0.1)
    try:
        t0 = time.perf_counter()
        assert tier.get(bid(1)) is None and not tier.contains(bid(1))
        with pytest.raises(TierUnavailable):
            tier.put(PutItem(bid(1), payload(1), NS))
        assert isinstance(TierUnavailable("x"), TierFull)
        assert tier.problem() is not None and tier.keys() == [] and tier.delete(bid(1)) == 0
        assert time.perf_counter() - t0 < 1.0
        server.start()
        time.sleep(0.15)
        assert tier.problem() is None
        tier.put(PutItem(bid(1), payload(1), NS))
        assert as_bytes(tier.get(bid(1))) == payload(1)
        server.stop()
        time.sleep(0.15)
        assert tier.problem() is not None  # an idle node notices the outage too
    finally:
        tier.close()
        server.stop()


def test_redis_killed_mid_load_and_restarted(tmp_path: Path) -> None:
    """Puts/gets from threads while the server is killed and restarted on the same port:
    only misses and TierUnavailable, each call fast, and full service within 5 s."""
    support = _support()
    server = support.RedisServer(tmp_path / "redis").start()
    tier = RedisTier(client_factory(server.url), 64 << 20, prefix="sctest:")
    stop = threading.Event()
    errors: list[BaseException] = []
    slowest = [0.0]
    outcomes = {"ok": 0, "miss": 0, "unavailable": 0}
    lock = threading.Lock()

    def load(worker: int) -> None:
        i = 0
        while not stop.is_set():
            h = bid(worker * 1_000_000 + i)
            i += 1
            try:
                t0 = time.perf_counter()
                try:
                    tier.put(PutItem(h, payload(i, 4096), NS))
                    kind = "ok"
                except TierUnavailable:
                    kind = "unavailable"
                got = tier.get(h)
                if got is None:
                    kind = "miss" if kind == "ok" else kind
                else:
                    assert as_bytes(got) == payload(i, 4096)
                with lock:
                    slowest[0] = max(slowest[0], time.perf_counter() - t0)
                    outcomes[kind] += 1
            except BaseException as exc:
                errors.append(exc)
                return

    threads = [threading.Thread(target=load, args=(w,)) for w in range(3)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.3)
        assert tier.problem() is None
        server.stop()  # SIGKILL mid-load
        time.sleep(0.5)
        assert tier.problem() is not None
        with lock:
            down_before = outcomes["unavailable"]
        assert down_before > 0
        server.start()
        restarted = time.monotonic()
        while tier.problem() is not None:
            assert time.monotonic() - restarted < 5.0, "no recovery within 5 s"
            time.sleep(0.05)
        recovered = time.monotonic() - restarted
        with lock:
            ok_at_recovery = outcomes["ok"]
        deadline = time.monotonic() + 5.0
        while True:
            with lock:
                if outcomes["ok"] > ok_at_recovery + 20:
                    break
            assert time.monotonic() < deadline, "puts did not resume"
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        tier.close()
        server.stop()
    assert not errors, errors[:3]
    assert recovered < 5.0
    # a dead Redis costs milliseconds: no call (a put and a get) took anywhere near a second
    assert slowest[0] < 1.0, slowest[0]
    assert tier.status().failures >= 1 and tier.status().recoveries >= 1


@pytest.mark.parametrize("damage", ["header-bit", "other-id", "cut-in-header"])
def test_a_damaged_header_met_by_locate_is_counted_and_deleted(
    tier: RedisTier, raw: redis.Redis, damage: str
) -> None:
    # a lookup adopts shared blocks from their headers alone: no get() would ever read a
    # value whose header is damaged, so locate_many itself counts and deletes it
    tier.put(PutItem(bid(1), payload(1), NS))
    tier.put(PutItem(bid(2), payload(2), NS))
    key = tier.key(bid(1))
    value = raw.get(key)
    assert isinstance(value, bytes)
    if damage == "header-bit":
        raw.setrange(key, 20, bytes([value[20] ^ 0x80]))  # inside the block id
    elif damage == "other-id":
        other = raw.get(tier.key(bid(2)))
        assert isinstance(other, bytes)
        raw.set(key, other)
    else:
        raw.set(key, value[: HEADER_SIZE // 2])
    found = tier.locate_many([bid(1), bid(2)])
    assert found[0] is None and found[1] is not None
    assert raw.exists(key) == 0 and tier.counters().corrupt_located == 1
    assert tier.corrupt_located() == 1
    assert tier.locate_many([bid(1)]) == [None] and tier.corrupt_located() == 1  # gone: a miss
