"""The shared Redis tier's values damaged (flipped payload and header bytes, truncation) for
blocks a node then reads from it, end to end: on every read path (REST by id, REST batch,
stream) the damaged block is detected, counted in ``/metrics``, its key deleted (Redis's
quarantine: nothing is kept that could be served later) and never served; the intact ones are
served byte-exact. The tier alone is covered in tests/tiers/test_redis.py.

The node stores a chain (written through to Redis), stops, and starts again without its disk
tier's files: it then holds nothing locally, a lookup adopts the chain from Redis (from the
headers alone) and every read of a payload goes to Redis."""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis

from sessioncache.connector import StreamClient, discover
from sessioncache.dataplane.frames.batch import decode_batch
from tests.faults.test_corruption import corrupt_reads
from tests.support.servers import start_server

NS = {"model": "redis-corrupt", "block_tokens": 4, "kv_dtype": "bf16", "kv_layout": "x"}
BLOCK = 4096
HEADER_SIZE = 88
REDIS_URL = "redis://127.0.0.1:6379/0"


def payload(bid: bytes) -> bytes:
    return bid * (BLOCK // 16)


@pytest.fixture
def prefix() -> Iterator[str]:
    name = f"t-corrupt-{uuid.uuid4().hex[:12]}:"
    yield name
    r = redis.Redis.from_url(REDIS_URL)
    keys = list(r.scan_iter(match=f"{name}*", count=1000))
    if keys:
        r.delete(*keys)


def test_damaged_redis_values_are_never_served(tmp_path: Path, prefix: str) -> None:
    data = tmp_path / "data"
    env = {
        "SESSIONCACHE_REDIS_URL": REDIS_URL,
        "SESSIONCACHE_REDIS_PREFIX": prefix,
        "SESSIONCACHE_REDIS_WRITE_POLICY": "write_through",
    }
    r = redis.Redis.from_url(REDIS_URL)
    toks = [int(t) for t in np.random.default_rng(5).integers(0, 9999, 4 * 9)]
    server = start_server(data, env)
    try:
        plan = httpx.post(
            f"{server.url}/v1/store", json={"namespace": NS, "tokens": toks}, timeout=10
        ).json()
        for h in plan["missing"]:
            put = httpx.put(f"{server.url}/v1/blocks/{h}", content=payload(bytes.fromhex(h)))
            assert put.status_code == 200, put.text
        ids: list[str] = plan["hashes"]
        keys = [f"{prefix}b:{h}" for h in ids]
        deadline = time.monotonic() + 10
        while sum(r.exists(k) for k in keys) < len(keys):
            assert time.monotonic() < deadline, "the chain never reached Redis"
            time.sleep(0.05)
    finally:
        server.stop()
    # the node forgets its local copies: the disk tier's files go (the CPU tier died with it)
    shutil.rmtree(data / "blocks", ignore_errors=True)
    # two damaged blocks per read path: a flipped payload byte, a flipped header byte (in the
    # namespace root: the header no longer describes the block), a value cut short
    damage = {1: "payload", 2: "cut", 4: "header", 5: "payload", 7: "cut", 8: "header"}
    for i, how in damage.items():
        value = r.get(keys[i])
        assert isinstance(value, bytes) and len(value) == HEADER_SIZE + BLOCK
        if how == "payload":
            r.setrange(keys[i], HEADER_SIZE + 100, bytes([value[HEADER_SIZE + 100] ^ 0x01]))
        elif how == "header":
            r.setrange(keys[i], 60, bytes([value[60] ^ 0x80]))
        else:
            ttl = r.pttl(keys[i])
            r.set(keys[i], value[: len(value) - 100], px=ttl if ttl > 0 else None)
    damaged = {ids[i] for i in damage}
    server = start_server(data, env)
    try:
        url = server.url
        before = corrupt_reads(url)
        # a lookup adopts what Redis holds of the chain: every header there reads as this block
        out = httpx.post(f"{url}/v1/lookup", json={"namespace": NS, "tokens": toks}).json()
        adopted = out["matched_blocks"]
        # the lookup read every header of the chain: the two damaged ones are counted and
        # deleted at once, and the chain is adopted up to the first of them
        assert adopted == 4
        assert corrupt_reads(url) - before == 2
        assert r.exists(keys[4]) == r.exists(keys[8]) == 0
        # REST by id: blocks 0-2
        for h in ids[0:3]:
            got = httpx.get(f"{url}/v1/blocks/{h}")
            if h in damaged:
                assert got.status_code == 404, (h, got.status_code)
            else:
                assert got.status_code == 200 and got.content == payload(bytes.fromhex(h))
        # REST batch: blocks 3-5
        batch = httpx.post(f"{url}/v1/blocks/batch", json={"hashes": ids[3:6]})
        for bid, data_ in decode_batch(batch.content):
            if bid.hex() in damaged:
                assert data_ is None
            elif ids.index(bid.hex()) < adopted:
                assert data_ == payload(bid)
        # stream: blocks 6-8
        with StreamClient.connect(discover(url), timeout=10) as client:
            loaded = client.load([bytes.fromhex(h) for h in ids[6:9]])
            for h, g in zip(ids[6:9], loaded, strict=True):
                if h in damaged:
                    assert g is None, h
                elif ids.index(h) < adopted:
                    assert g is not None and bytes(g) == payload(bytes.fromhex(h))
        # every damaged value a read reached was counted and deleted (Redis's quarantine):
        # 1, 2 by REST, 7 by the stream (which asks Redis for ids it does not hold), 4 and 8
        # by the lookup; 5 sits behind 4 in the chain and was never adopted, so never read
        gone = [i for i in damage if not r.exists(keys[i])]
        assert gone == [1, 2, 4, 7, 8]
        assert corrupt_reads(url) - before == len(gone)
        # the intact ones stay in Redis; none of the damaged is ever served again
        assert r.exists(keys[0]) == 1
        for h in damaged:
            assert httpx.get(f"{url}/v1/blocks/{h}").status_code == 404
        out = httpx.post(f"{url}/v1/lookup", json={"namespace": NS, "tokens": toks}).json()
        assert out["matched_blocks"] == 1  # the chain now stops before its first damaged block
    finally:
        server.stop()
