"""The Redis tier and the fleet index on a real 3-master Redis Cluster, started here from
redis-server processes (``redis-cli --cluster create``) and torn down by pid."""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from redis.cluster import RedisCluster

from sessioncache.fleet import FleetIndex
from sessioncache.hashing import BlockHash
from sessioncache.redis_link import make_client
from sessioncache.redis_link import sends_parts as _sends_parts
from sessioncache.tiers.base import PutItem, Tier
from sessioncache.tiers.redis import HEADER_SIZE, RedisTier

NS = b"\x07" * 16
TESTS = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path) -> ModuleType:
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _support() -> ModuleType:
    return _load("sessioncache_tests_redis_support", TESTS / "support" / "redis_cluster.py")


def _conformance() -> ModuleType:
    return _load("sessioncache_tests_conformance", TESTS / "tiers" / "test_conformance.py")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    procs = _support().RedisClusterProcs(tmp_path_factory.mktemp("cluster"), masters=3).start()
    pids = list(procs.pids)
    assert len(pids) == 3
    try:
        yield procs
    finally:
        procs.stop()
        for pid in pids:  # torn down by pid: every process is gone
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


@pytest.fixture
def client(cluster: Any) -> Iterator[RedisCluster]:
    made = make_client(cluster.url)
    assert isinstance(made, RedisCluster) and _sends_parts(made)  # values sent without copies
    yield made
    made.close()


@pytest.fixture
def make_tier(cluster: Any) -> Iterator[Callable[[int], Tier]]:
    made: list[RedisTier] = []

    def factory(capacity: int) -> Tier:
        tier = RedisTier(
            lambda: make_client(cluster.url),
            capacity,
            prefix=f"sctest:{uuid.uuid4().hex}:",
            owns_keys=True,
        )
        made.append(tier)
        return tier

    yield factory
    for tier in made:
        tier.close()


def bid(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def payload(i: int, size: int = 256) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def _conformance_cases() -> list[str]:
    module = _conformance()
    return sorted(
        name
        for name, fn in vars(module).items()
        if name.startswith("test_")
        and callable(fn)
        and "make_tier" in inspect.signature(fn).parameters
    )


@pytest.mark.parametrize("case", _conformance_cases())
def test_conformance_suite_on_the_cluster(case: str, make_tier: Callable[[int], Tier]) -> None:
    fn = getattr(_conformance(), case)
    params = inspect.signature(fn).parameters
    if "size" in params:
        for size in (0, 4097):
            fn(make_tier, size)
    else:
        fn(make_tier)


def test_batches_spread_over_every_shard(make_tier: Callable[[int], Tier], client: Any) -> None:
    tier = make_tier(1 << 24)
    assert isinstance(tier, RedisTier)
    n = 60
    items = [PutItem(bid(i), payload(i, 2000), NS, bid(i - 1) if i else None) for i in range(n)]
    assert tier.put_many(items) == [True] * n
    shards = {client.get_node_from_key(tier.key(bid(i))).port for i in range(n)}
    assert len(shards) == 3  # no hash tag: one chain lands on every primary
    got = tier.get_many([bid(i) for i in range(n + 2)])
    assert [bytes(g.numpy()) if g is not None else None for g in got] == [
        payload(i, 2000) for i in range(n)
    ] + [None, None]
    located = tier.locate_many([bid(i) for i in range(n)])
    assert all(r is not None and r.nbytes == 2000 for r in located)
    assert [r.parent for r in located if r is not None] == [None] + [bid(i) for i in range(n - 1)]
    assert sorted(tier.keys()) == sorted(bid(i) for i in range(n))
    used, _limit = tier.server_memory()
    assert used > n * 2000
    assert tier.delete_many([bid(i) for i in range(n)]) == [2000] * n


def test_corrupt_value_on_a_shard_is_deleted(make_tier: Callable[[int], Tier], client: Any) -> None:
    tier = make_tier(1 << 20)
    assert isinstance(tier, RedisTier)
    tier.put(PutItem(bid(1), payload(1), NS))
    client.setrange(tier.key(bid(1)), HEADER_SIZE + 3, b"\xff\xfe")
    assert tier.get(bid(1)) is None and client.exists(tier.key(bid(1))) == 0


def test_expiry_on_the_cluster(make_tier: Callable[[int], Tier], client: Any) -> None:
    tier = make_tier(1 << 20)
    assert isinstance(tier, RedisTier)
    expires = time.time() + 777
    tier.put(PutItem(bid(1), payload(1), NS, expires_at=expires))
    assert abs(client.pttl(tier.key(bid(1))) / 1000 - 777) < 2
    tier.set_expiry(bid(1), expires + 100)
    assert client.pttl(tier.key(bid(1))) > 870_000


def test_fleet_index_on_the_cluster(cluster: Any, client: Any) -> None:
    prefix = f"sctest:{uuid.uuid4().hex}:"
    a = FleetIndex(make_client(cluster.url), "a", prefix=prefix)
    b = FleetIndex(make_client(cluster.url), "b", prefix=prefix)
    try:
        assert a.register() and b.register()
        hashes = [bid(i) for i in range(30)]
        a.publish([(h, "cpu") for h in hashes], time.time() + 60)
        b.publish([(h, "disk") for h in hashes[::2]], time.time() + 60)
        a.flush()
        b.flush()
        got = b.locations(hashes)
        assert got == [
            {"a": ["cpu"], "b": ["disk"]} if i % 2 == 0 else {"a": ["cpu"]} for i in range(30)
        ]
    finally:
        a.close()
        b.close()
        keys = list(client.scan_iter(match=prefix + "*"))
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.unlink(key)
        pipe.execute()
