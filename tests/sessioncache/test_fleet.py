"""The fleet-wide block index against real Redis: nodes see each other's holdings, lapsed or
departed nodes drop out, the store feeds it through an observer, and it survives Redis dying
and coming back empty."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import redis

from sessioncache.errors import InvalidInput
from sessioncache.fleet import FleetIndex, FleetObserver
from sessioncache.hashing import BlockHash
from sessioncache.redis_link import client_factory, make_client
from sessioncache.store import TieredStore
from sessioncache.tiers.cpu import CpuTier

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


@pytest.fixture
def raw() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(URL)
    yield client
    client.close()


@pytest.fixture
def prefix(raw: redis.Redis) -> Iterator[str]:
    value = f"sctest:{uuid.uuid4().hex}:"
    yield value
    keys = list(raw.scan_iter(match=value + "*", count=1000))
    if keys:
        raw.unlink(*keys)


def wait_until(predicate: object, timeout_s: float = 5.0) -> float:
    start = time.monotonic()
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() - start < timeout_s, "condition not met in time"
        time.sleep(0.02)
    return time.monotonic() - start


def test_two_nodes_see_each_others_locations(prefix: str, raw: redis.Redis) -> None:
    a = FleetIndex(make_client(URL), "node-a", prefix=prefix, info={"url": "http://a"})
    b = FleetIndex(make_client(URL), "node-b", prefix=prefix)
    assert a.register() and b.register()
    expires = time.time() + 600
    a.publish([(bid(1), "cpu"), (bid(2), "cpu"), (bid(2), "disk")], expires)
    b.publish([(bid(2), "gpu")], expires)
    assert a.pending == 3 and b.locations([bid(1)]) == [{}]  # queued, not sent yet
    assert a.flush() == 3 and b.flush() == 1 and a.pending == 0
    assert b.locations([bid(1), bid(2), bid(3)]) == [
        {"node-a": ["cpu"]},
        {"node-a": ["cpu", "disk"], "node-b": ["gpu"]},
        {},
    ]
    # key expiry: the block's expiry plus the garbage-collection grace
    pttl = raw.pttl(f"{prefix}loc:{bid(2).hex()}")
    assert 600_000 + 3_590_000 < pttl <= 600_000 + 3_600_000
    a.withdraw([bid(2)], "cpu")
    a.withdraw([bid(1)])  # every tier of this node
    a.flush()
    assert a.locations([bid(1), bid(2)]) == [{}, {"node-a": ["disk"], "node-b": ["gpu"]}]
    nodes = a.nodes()
    assert set(nodes) == {"node-a", "node-b"} and nodes["node-a"].info["url"] == "http://a"
    assert a.problem() is None


def test_latest_queued_operation_wins(prefix: str) -> None:
    a = FleetIndex(make_client(URL), "a", prefix=prefix)
    a.register()
    a.publish([(bid(1), "cpu")], time.time() + 60)
    a.withdraw([bid(1)], "cpu")
    a.withdraw([bid(2)], "cpu")
    a.publish([(bid(2), "cpu")], time.time() + 60)
    assert a.flush() == 2
    assert a.locations([bid(1), bid(2)]) == [{}, {"a": ["cpu"]}]


def test_nothing_is_sent_before_registration(prefix: str) -> None:
    a = FleetIndex(make_client(URL), "a", prefix=prefix)
    a.publish([(bid(1), "cpu")], time.time() + 60)
    assert a.flush() == 0 and a.pending == 1
    assert a.problem() is not None  # reachable, but not registered
    assert a.register() and a.flush() == 1 and a.problem() is None
    assert a.locations([bid(1)]) == [{"a": ["cpu"]}]


def test_touch_extends_location_expiry(prefix: str, raw: redis.Redis) -> None:
    a = FleetIndex(make_client(URL), "a", prefix=prefix, gc_grace_s=0, touch_interval_s=0)
    a.register()
    a.publish([(bid(1), "cpu")], time.time() + 100)
    a.flush()
    assert raw.pttl(f"{prefix}loc:{bid(1).hex()}") <= 100_000
    a.touch([(bid(1), time.time() + 500), (bid(1), time.time() + 400)])
    a.flush(touches=True)
    assert raw.pttl(f"{prefix}loc:{bid(1).hex()}") > 490_000


def test_a_lapsed_node_drops_out_and_a_departed_one_is_cleaned_up(
    prefix: str, raw: redis.Redis
) -> None:
    a = FleetIndex(make_client(URL), "a", prefix=prefix, live_cache_s=0.0)
    b = FleetIndex(make_client(URL), "b", prefix=prefix, ttl_s=0.5)
    c = FleetIndex(make_client(URL), "c", prefix=prefix)
    for node in (a, b, c):
        node.register()
        node.publish([(bid(1), "disk")], time.time() + 600)
        node.flush()
    assert a.locations([bid(1)]) == [{"a": ["disk"], "b": ["disk"], "c": ["disk"]}]
    c.deregister()  # left: its fields are void at once and readers delete them
    assert a.locations([bid(1)]) == [{"a": ["disk"], "b": ["disk"]}]
    a.flush()
    assert not raw.hexists(f"{prefix}loc:{bid(1).hex()}", f"{c.member}|disk")
    time.sleep(0.6)  # b's heartbeat lapses: hidden, but kept in case it comes back
    assert a.locations([bid(1)]) == [{"a": ["disk"]}]
    assert set(a.nodes()) == {"a"}
    b.register()
    assert a.locations([bid(1)]) == [{"a": ["disk"], "b": ["disk"]}]


def test_a_new_node_is_seen_despite_the_cache(prefix: str) -> None:
    a = FleetIndex(make_client(URL), "a", prefix=prefix, live_cache_s=60)
    a.register()
    assert a.locations([bid(1)]) == [{}]
    b = FleetIndex(make_client(URL), "b", prefix=prefix)
    b.register()
    b.publish([(bid(1), "cpu")], time.time() + 60)
    b.flush()
    assert a.locations([bid(1)]) == [{"b": ["cpu"]}]


def test_node_ids_are_checked() -> None:
    for bad in ["", "a#b", "a|b"]:
        with pytest.raises(InvalidInput):
            FleetIndex(make_client(URL), bad)


def test_store_observer_feeds_the_index(prefix: str) -> None:
    fleet = FleetIndex(make_client(URL), "node-1", prefix=prefix, flush_interval_s=0.01)
    store = TieredStore(
        [CpuTier(2048, name="cpu", chunk_bytes=2048), CpuTier(1 << 20, name="cpu2")],
        observers=[FleetObserver(fleet, exclude=["cpu2"])],
    )
    fleet.start()
    try:
        hashes = [bid(i) for i in range(1, 5)]
        store.writes.put(hashes[:2], [b"\x01" * 1024] * 2, namespace_root=NS)
        wait_until(lambda: fleet.locations(hashes[:2]) == [{"node-1": ["cpu"]}] * 2)
        store.writes.put(hashes[2:], [b"\x02" * 1024] * 2, namespace_root=NS, parent=hashes[1])
        # the cpu tier holds two blocks: older blocks are demoted to cpu2, which is not published
        wait_until(lambda: [bool(x) for x in fleet.locations(hashes)].count(True) == 2)
        store.writes.delete(hashes)
        wait_until(lambda: fleet.locations(hashes) == [{}] * 4)
    finally:
        fleet.stop()
        store.close()
    assert fleet.nodes() == {}  # stop() deregisters


def test_start_publishes_what_the_node_holds(prefix: str) -> None:
    held = [(bid(i), "disk", time.time() + 60) for i in range(2500)]
    fleet = FleetIndex(make_client(URL), "n", prefix=prefix, held=lambda: iter(held))
    reader = FleetIndex(make_client(URL), "r", prefix=prefix)
    fleet.start()
    try:
        wait_until(lambda: reader.locations([bid(2499)]) == [{"n": ["disk"]}])
        assert all(loc == {"n": ["disk"]} for loc in reader.locations([h for h, _, _ in held]))
    finally:
        fleet.stop()


def test_redis_dies_and_comes_back_empty(tmp_path: Path) -> None:
    """Redis killed and restarted (keeping nothing): the node keeps serving (empty answers),
    queues its publications, re-registers by itself, and republishes under a new
    incarnation."""
    support = _support()
    server = support.RedisServer(tmp_path / "redis").start()
    held = {bid(1): "disk"}
    fleet = FleetIndex(
        client_factory(server.url),
        "n",
        prefix="sctest:",
        ttl_s=3,
        held=lambda: [(h, t, time.time() + 600) for h, t in held.items()],
        flush_interval_s=0.02,
    )
    reader = FleetIndex(client_factory(server.url), "r", prefix="sctest:", live_cache_s=0)
    fleet.start()
    try:
        wait_until(lambda: reader.locations([bid(1)]) == [{"n": ["disk"]}])
        first = fleet.member
        server.stop()
        t0 = time.perf_counter()
        assert fleet.locations([bid(1), bid(2)]) == [{}, {}]
        held[bid(2)] = "cpu"
        fleet.publish([(bid(2), "cpu")], time.time() + 600)  # queued, not lost
        assert time.perf_counter() - t0 < 1.0
        wait_until(lambda: fleet.problem() is not None)
        server.start()
        restarted = time.monotonic()
        wait_until(lambda: fleet.problem() is None and fleet.registered)
        wait_until(lambda: reader.locations([bid(1), bid(2)]) == [{"n": ["disk"]}, {"n": ["cpu"]}])
        assert time.monotonic() - restarted < 5.0
        assert fleet.member != first  # Redis lost the registration: a new incarnation
        assert fleet.status().recoveries >= 1
    finally:
        fleet.stop()
        reader.close()
        server.stop()
