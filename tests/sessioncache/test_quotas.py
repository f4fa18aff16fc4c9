"""Admission before grant (``quotas``): counts admitted up to each tenant's bound, and pinned
bytes (leases, session pins, stagings) admitted with their size against each tenant's share of
each tier, atomically with the grant; the pin budget unpins the tenant over its share first."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

from sessioncache.clock import ManualClock
from sessioncache.errors import InvalidInput, QuotaExceeded
from sessioncache.hashing import BlockHash, Namespace, block_hashes
from sessioncache.quotas import Counts, PinBudget, Quotas, TenantLimits
from sessioncache.sessions.manager import SessionManager
from sessioncache.store import TieredStore
from sessioncache.store.eviction import EvictionPolicy
from sessioncache.tiers.cpu import CpuTier

SIZE = 64
LIMITS = TenantLimits(
    **{**dict.fromkeys(TenantLimits._fields, 10), "stream_connections": 2, "sessions": 2}
)
NAMESPACES = {tenant: Namespace(f"model-{tenant}", 4, "u8", "x") for tenant in ("alice", "bob")}


def chain(tenant: str, seed: int, blocks: int) -> list[BlockHash]:
    tokens = [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, blocks * 4)]
    return block_hashes(NAMESPACES[tenant], tokens)


def root(tenant: str) -> bytes:
    return NAMESPACES[tenant].root()


def put(store: TieredStore, tenant: str, hashes: list[BlockHash]) -> None:
    payloads = [(h * 4)[:SIZE] for h in hashes]
    assert store.writes.put(hashes, payloads, namespace_root=root(tenant)).stored == hashes


def budget(tenant: str, share: float = 0.5) -> PinBudget:
    return PinBudget(tenant, share, [root(tenant)])


def pinned(store: TieredStore, tenant: str) -> int:
    return store.reads.pinned_under([root(tenant)])[0]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def test_counts_are_admitted_up_to_each_tenants_bound_and_refused_naming_it() -> None:
    quotas = Quotas(LIMITS, {"bob": {"stream_connections": 1}})
    connections = quotas.tally("stream_connections")
    connections.admit("alice")
    connections.admit("alice")
    connections.admit("bob")
    with pytest.raises(QuotaExceeded, match="stream_connections"):
        connections.admit("bob")  # his own bound: alice's two never counted against it
    connections.release("bob")
    connections.admit("bob")
    assert quotas.usage()["stream_connections"] == {"alice": 2, "bob": 1}
    quotas.admit("alice", "sessions", held=1)  # a count kept by what it counts
    with pytest.raises(QuotaExceeded, match=r"holds 2 open sessions and asks 1 more.*sessions"):
        quotas.admit("alice", "sessions", held=2)


def test_shares_are_overridden_per_tenant_within_their_range() -> None:
    quotas = Quotas(
        LIMITS._replace(write_behind_share=0.5, pin_share=0.5),
        {"bob": {"write_behind_share": 0.25, "pin_share": 0}},
    )
    assert quotas.write_behind_share("bob") == 0.25
    assert quotas.write_behind_share("alice") == 0.5
    assert quotas.of("bob").pin_share == 0  # no pins at all: a bound of its own
    for bad in (0, 1.5, True, "half"):  # a tenant with no queue share could never store
        with pytest.raises(InvalidInput, match="write_behind_share"):
            Quotas(LIMITS, {"bob": {"write_behind_share": bad}})
    admit = quotas.admitter("namespaces")
    admit("alice", 9)
    with pytest.raises(QuotaExceeded, match="namespaces"):
        admit("alice", 10)
    with pytest.raises(ValueError):
        quotas.admitter("pin_share")  # a share, not a count


def test_a_grant_fits_as_far_as_the_bytes_it_adds_stay_within_each_tiers_room() -> None:
    pins = PinBudget("t", 0.5, [])
    sizes = np.array([[10, 0], [10, 5], [0, 0], [10, 0]], np.int64)
    assert pins.admit(sizes, np.array([30, 5], np.int64)) == 4
    assert pins.admit(sizes, np.array([25, 5], np.int64)) == 3
    assert pins.admit(sizes, np.array([30, 4], np.int64)) == 1
    # over its share of the second tier already: blocks adding nothing there still fit
    assert pins.admit(sizes[[0, 2, 3]], np.array([30, -1], np.int64)) == 3
    assert pins.admit(sizes[:0], np.array([30, 5], np.int64)) == 0


def test_a_lease_is_cut_to_the_tenants_share_and_refused_when_nothing_fits(
    clock: ManualClock,
) -> None:
    store = TieredStore([CpuTier(20 * SIZE)], clock=clock)
    mine, more = chain("bob", 1, 16), chain("bob", 2, 2)
    put(store, "bob", mine)
    put(store, "bob", more)
    first = store.reads.lookup(mine, lease_s=60, budget=budget("bob"))
    assert first.num_blocks == 10 and first.cut == "pin_share" and first.lease is not None
    assert pinned(store, "bob") == 10 * SIZE
    again = store.reads.lookup(mine, lease_s=60, budget=budget("bob"))  # pinned already
    assert again.num_blocks == 10 and again.cut == "pin_share"
    assert pinned(store, "bob") == 10 * SIZE
    with pytest.raises(QuotaExceeded, match="pin_share"):
        store.reads.lookup(more, lease_s=60, budget=budget("bob"))
    unleased = store.reads.lookup(more)  # a lookup without a lease is never cut
    assert unleased.num_blocks == 2 and unleased.cut is None
    alice = chain("alice", 3, 4)
    put(store, "alice", alice)
    assert store.reads.lookup(alice, lease_s=60, budget=budget("alice")).num_blocks == 4


def test_concurrent_leases_of_one_tenant_never_pass_its_share(clock: ManualClock) -> None:
    store = TieredStore([CpuTier(64 * SIZE)], clock=clock)
    chains = [chain("bob", seed, 6) for seed in range(8)]
    for hashes in chains:
        put(store, "bob", hashes)
    start = threading.Barrier(len(chains))

    def lease(hashes: list[BlockHash]) -> None:
        start.wait()
        with contextlib.suppress(QuotaExceeded):  # once nothing fits
            store.reads.lookup(hashes, lease_s=60, budget=budget("bob", 0.25))

    threads = [threading.Thread(target=lease, args=(hashes,)) for hashes in chains]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pinned(store, "bob") == 16 * SIZE  # 48 asked for, a quarter of 64 granted


def test_a_session_pin_pins_the_prefix_that_fits_the_tenants_share(clock: ManualClock) -> None:
    store = TieredStore([CpuTier(20 * SIZE)], clock=clock, default_ttl_s=3600)
    sm = SessionManager(store, pin_share=1.0, budget=lambda tenant: budget(tenant, 0.25))
    for tenant in ("alice", "bob"):
        sm.open("s", tenant=tenant)
    bob = chain("bob", 1, 8)
    put(store, "bob", bob)
    sm.record("s", bob, tenant="bob")
    assert pinned(store, "bob") == 5 * SIZE
    more = chain("bob", 2, 2)
    put(store, "bob", more)
    sm.open("t", tenant="bob")
    sm.record("t", more, tenant="bob")  # his other session: no room left
    assert pinned(store, "bob") == 5 * SIZE
    alice = chain("alice", 3, 4)
    put(store, "alice", alice)
    sm.record("s", alice, tenant="alice")
    assert pinned(store, "alice") == 4 * SIZE


def test_the_pin_budget_unpins_the_tenant_pinning_most_first(clock: ManualClock) -> None:
    store = TieredStore(
        [CpuTier(20 * SIZE)], EvictionPolicy.named("forecast", 1), clock=clock, default_ttl_s=1e5
    )
    sm = SessionManager(  # 10 blocks of pins, every tenant together
        store, pin_share=0.5, pinned_of=lambda tenant: store.reads.pinned_under([root(tenant)])
    )
    sm.open("a", tenant="alice")
    stop = chain("alice", 1, 3)
    put(store, "alice", stop)
    sm.record("a", stop, tenant="alice", finish_reason="stop")  # back late, by its forecast
    for i in range(3):
        clock.advance(1)
        sm.open(f"b{i}", tenant="bob")
        loop = chain("bob", 10 + i, 3)
        put(store, "bob", loop)
        sm.record(f"b{i}", loop, tenant="bob", finish_reason="tool_use")  # back soon
    assert ("alice", "a") in sm.pinned_sessions()
    assert pinned(store, "alice") == 3 * SIZE and pinned(store, "bob") <= 7 * SIZE


def test_a_staging_holds_the_slots_that_fit_the_share(clock: ManualClock) -> None:
    store = TieredStore([CpuTier(20 * SIZE)], clock=clock)
    staged = Counts()
    stagings = PinBudget("bob", 0.5, [root("bob")], staged, 0)
    assert store.reads.hold(stagings, "cpu", SIZE, 6) == 6
    assert store.reads.hold(stagings, "cpu", SIZE, 6) == 4
    assert store.reads.hold(stagings, "cpu", SIZE, 1) == 0
    assert staged.get("bob") == 10 * SIZE
    staged.add("bob", -4 * SIZE)
    mine = chain("bob", 1, 8)
    put(store, "bob", mine)
    assert store.reads.lookup(mine, lease_s=60, budget=stagings).num_blocks == 4
