"""The shared tier's key expiries follow the store's sliding TTLs (a real Redis)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis

from sessioncache.clock import ManualClock
from sessioncache.hashing import BlockHash
from sessioncache.redis_link import make_client
from sessioncache.store import TieredStore
from sessioncache.store.shared_expiry import SharedExpiryRefresher
from sessioncache.tiers.cpu import CpuTier
from sessioncache.tiers.redis import RedisTier

URL = os.environ.get("SESSIONCACHE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
ROOT = b"\x07" * 16


@pytest.fixture
def shared() -> Iterator[tuple[RedisTier, redis.Redis]]:
    prefix = f"sctest:{uuid.uuid4().hex}:"
    raw = redis.Redis.from_url(URL)
    tier = RedisTier(lambda: make_client(URL), 1 << 30, prefix=prefix, owns_keys=True)
    yield tier, raw
    tier.close()
    keys = list(raw.scan_iter(match=prefix + "*", count=1000))
    if keys:
        raw.unlink(*keys)
    raw.close()


def test_a_lookup_raises_the_shared_expiry_of_the_blocks_the_shared_tier_holds(
    shared: tuple[RedisTier, redis.Redis],
) -> None:
    tier, raw = shared
    clock = ManualClock(start=1_900_000_000.0)
    refresher = SharedExpiryRefresher(tier, tier.name)
    store = TieredStore(
        [CpuTier(1 << 20), tier],
        clock=clock,
        observers=[refresher],
        write_through=[tier.name],
    )
    refresher.bind(1)
    chain = [BlockHash(i.to_bytes(16, "big")) for i in range(1, 7)]
    store.writes.put(chain[:4], [h * 4 for h in chain[:4]], namespace_root=ROOT, ttl_s=100.0)
    store.writes.put(chain[4:], [h * 4 for h in chain[4:]], namespace_root=ROOT, parent=chain[3])
    store.writes.delete(chain[4:])  # not held: nothing to refresh for them
    refresher.flush()
    before = [raw.pexpiretime(tier.key(h)) for h in chain[:4]]
    clock.advance(50.0)
    assert store.reads.lookup(chain).num_blocks == 4
    assert refresher.flush() == 4
    after = [raw.pexpiretime(tier.key(h)) for h in chain[:4]]
    assert all(a == b + 50_000 for a, b in zip(after, before, strict=True))
    store.close()
