"""Sessions over days, with the injected clock: sliding TTLs, pins, the pin budget, the sweep."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest

from sessioncache.clock import ManualClock
from sessioncache.errors import InvalidInput, SessionNotFound
from sessioncache.hashing import BlockHash, Namespace, block_hashes
from sessioncache.sessions.hints import Hint
from sessioncache.sessions.manager import DAY_S, SessionManager
from sessioncache.store import TieredStore
from sessioncache.store.eviction import EvictionPolicy
from sessioncache.tiers.cpu import CpuTier
from tests.support.session_store import put_in_session

NS = Namespace("test-model", 4, "float16", "test-layout")
ROOT = NS.root()
SIZE = 64
HOUR = 3600.0


def tokens(seed: int, blocks: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, blocks * 4)]


def data(h: bytes) -> bytes:
    return (h * 4)[:SIZE]


def make(blocks: int, clock: ManualClock, **kw: float) -> tuple[TieredStore, SessionManager]:
    store = TieredStore([CpuTier(blocks * SIZE)], clock=clock, default_ttl_s=HOUR)
    return store, SessionManager(store, **kw)  # type: ignore[arg-type]


def store_turn(sm: SessionManager, sid: str, hashes: list[BlockHash]) -> None:
    match = sm.lookup(sid, hashes)
    new = hashes[match.num_blocks :]
    put_in_session(sm, sid, new, [data(h) for h in new], namespace_root=ROOT, prefix=match.hashes)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def test_a_session_idle_for_two_days_still_hits_and_one_past_its_ttl_misses(clock: ManualClock):
    store, sm = make(64, clock, idle_timeout_s=HOUR)
    agent = sm.open("agent-1", kind="agent")
    chat = sm.open("chat-1", kind="chat")
    a, c = block_hashes(NS, tokens(1, 6)), block_hashes(NS, tokens(2, 6))
    store_turn(sm, agent.id, a)
    store_turn(sm, chat.id, c)
    clock.advance(2 * DAY_S)
    sm.sweep()
    assert sm.lookup(agent.id, a).num_blocks == 6  # the default block TTL is one hour
    clock.advance(3 * DAY_S + 1)  # the agent session (3 days) is now past its TTL
    report = sm.sweep()
    assert report.expired_sessions == 1 and report.expired_blocks == 6
    with pytest.raises(SessionNotFound):
        sm.get(agent.id)
    assert store.reads.lookup(a).num_blocks == 0
    assert sm.lookup(chat.id, c).num_blocks == 6  # chat: 7 days since its last turn


def test_every_request_slides_the_session_ttl(clock: ManualClock):
    _, sm = make(64, clock)
    session = sm.open("s", kind="agent")
    hashes = block_hashes(NS, tokens(1, 2))
    for _ in range(5):
        clock.advance(2 * DAY_S)
        store_turn(sm, session.id, hashes)
    assert sm.get("s").expires_at == clock.now() + 3 * DAY_S


def test_pinned_chains_survive_capacity_pressure(clock: ManualClock):
    store, sm = make(10, clock, pin_share=1.0)
    live = sm.open("live")
    chain = block_hashes(NS, tokens(1, 6))
    store_turn(sm, live.id, chain)
    for i in range(30):  # session-less traffic far beyond capacity
        clock.advance(1)
        other = block_hashes(NS, tokens(100 + i, 2))
        store.writes.put(other, [data(h) for h in other], namespace_root=ROOT)
    assert store.reads.lookup(chain).num_blocks == 6
    sm.close(live.id)  # the pins go; the blocks now age out like any other
    for i in range(10):
        clock.advance(1)
        other = block_hashes(NS, tokens(200 + i, 2))
        store.writes.put(other, [data(h) for h in other], namespace_root=ROOT)
    assert store.reads.lookup(chain).num_blocks == 0


def test_shared_prefix_lives_as_long_as_the_longest_lived_session(clock: ManualClock):
    store, sm = make(64, clock)
    system = tokens(7, 3)
    agent, chat = sm.open("a", kind="agent"), sm.open("c", kind="chat")
    a = block_hashes(NS, system + tokens(1, 2))
    c = block_hashes(NS, system + tokens(2, 2))
    store_turn(sm, agent.id, a)
    store_turn(sm, chat.id, c)
    shared = a[:3]
    assert c[:3] == shared
    meta = store.reads.meta(shared[0])
    assert meta is not None and meta.ttl_s == 7 * DAY_S
    sm.close("a")
    sm.close("c")
    clock.advance(5 * DAY_S)
    sm.sweep()
    assert store.reads.lookup(shared).num_blocks == 3  # the chat TTL carries the shared prefix
    assert store.reads.lookup(a).num_blocks == 3  # the agent's own tail (3 days) is gone


def test_idle_timeout_releases_pins_and_the_next_turn_pins_again(clock: ManualClock):
    store, sm = make(64, clock, idle_timeout_s=HOUR)
    sm.open("s")
    chain = block_hashes(NS, tokens(1, 4))
    store_turn(sm, "s", chain)
    assert sm.pinned_sessions() == [("default", "s")] and store.stats().pinned_blocks == 4
    clock.advance(HOUR + 1)
    assert sm.sweep().idle_unpinned == 1
    assert store.stats().pinned_blocks == 0 and not sm.get("s").pinned
    store_turn(sm, "s", chain)
    assert sm.get("s").pinned and store.stats().pinned_blocks == 4


def test_pin_budget_unpins_the_least_recently_active_sessions(clock: ManualClock):
    store, sm = make(20, clock, pin_share=0.5)  # at most 10 pinned blocks
    for i, sid in enumerate(["old", "mid", "new"]):
        sm.open(sid)
        clock.advance(1)
        store_turn(sm, sid, block_hashes(NS, tokens(i, 4)))
    assert [k[1] for k in sm.pinned_sessions()] == ["mid", "new"]
    assert store.stats_tiers()[0].pinned_bytes <= 10 * SIZE
    clock.advance(1)
    store_turn(sm, "old", block_hashes(NS, tokens(0, 4)))  # activity pins it again
    assert [k[1] for k in sm.pinned_sessions()] == ["new", "old"]


def test_pins_never_make_the_cache_refuse_work(clock: ManualClock):
    store, sm = make(8, clock, pin_share=0.5)
    for i in range(6):
        sid = f"s{i}"
        sm.open(sid)
        clock.advance(1)
        store_turn(sm, sid, block_hashes(NS, tokens(i, 3)))
    fresh = block_hashes(NS, tokens(99, 4))
    result = store.writes.put(fresh, [data(h) for h in fresh], namespace_root=ROOT)
    assert result.stored == fresh


def test_record_pins_blocks_stored_by_other_means(clock: ManualClock):
    store, sm = make(64, clock)
    sm.open("s", kind="chat")
    chain = block_hashes(NS, tokens(1, 3))
    store.writes.put(chain, [data(h) for h in chain], namespace_root=ROOT)
    sm.record("s", chain)
    assert sm.get("s").head == chain[-1] and store.stats().pinned_blocks == 3
    meta = store.reads.meta(chain[0])
    assert meta is not None and meta.ttl_s == 7 * DAY_S
    assert store.reads.chain_to(chain[-1]) == chain


def test_tenants_cannot_see_each_others_sessions(clock: ManualClock):
    _, sm = make(8, clock)
    sm.open("s", tenant="acme", kind="chat")
    with pytest.raises(SessionNotFound):
        sm.get("s", tenant="other")
    # one id, two tenants: two sessions, each independent of the other
    assert sm.open("s", tenant="other").kind == "agent"
    assert sm.get("s", tenant="acme").kind == "chat"
    sm.close("s", tenant="other")
    assert [s.id for s in sm.list_sessions(tenant="acme")] == ["s"]
    assert sm.list_sessions(tenant="other") == []


def test_bad_input(clock: ManualClock):
    store, sm = make(8, clock)
    with pytest.raises(InvalidInput):
        sm.open(kind="batch")
    with pytest.raises(InvalidInput):
        sm.open(ttl_s=-1)
    for bad in ["", "a/b", "x" * 200, "tab\there"]:
        with pytest.raises(InvalidInput):
            sm.open(bad)
    with pytest.raises(InvalidInput):
        SessionManager(store, kind_ttls={"agent": 0})
    with pytest.raises(InvalidInput):
        SessionManager(store, pin_share=1.5)
    with pytest.raises(SessionNotFound):
        sm.close("never-opened")


def test_configured_kinds_and_extend(clock: ManualClock):
    _, sm = make(8, clock, kind_ttls={"agent": HOUR, "batch": 10 * DAY_S})  # type: ignore[arg-type]
    batch = sm.open(kind="batch")
    assert batch.ttl_s == 10 * DAY_S and len(batch.id) == 32
    clock.advance(HOUR)
    extended = sm.extend(batch.id, ttl_s=20 * DAY_S)
    assert extended.expires_at == clock.now() + 20 * DAY_S


def test_worked_example_of_docs_sessions_md():
    """docs/sessions.md's table, step by step (block_tokens 4 here; the shape is the same)."""
    clock = ManualClock(start=0.0)
    store = TieredStore([CpuTier(100 * SIZE), CpuTier(1000 * SIZE, name="disk-like")], clock=clock)
    sm = SessionManager(store, idle_timeout_s=HOUR)
    system = tokens(1, 10)
    a_prompt = block_hashes(NS, system + tokens(2, 10))
    c_prompt = block_hashes(NS, system + tokens(3, 5))
    sm.open("A", kind="agent")
    store_turn(sm, "A", a_prompt)  # Mon 09:00
    assert store.reads.meta(a_prompt[15]).expires_at == 3 * DAY_S  # type: ignore[union-attr]
    clock.advance(300)  # Mon 09:05
    sm.open("C", kind="chat")
    store_turn(sm, "C", c_prompt)
    assert store.reads.meta(a_prompt[0]).ttl_s == 7 * DAY_S  # type: ignore[union-attr]
    assert store.reads.meta(a_prompt[15]).ttl_s == 3 * DAY_S  # type: ignore[union-attr]
    clock.advance(HOUR)  # Mon 10:05
    assert sm.sweep().idle_unpinned == 2 and store.stats().pinned_blocks == 0
    clock.advance(3300)  # Mon 11:00: 300 blocks of session-less traffic
    for i in range(100):
        other = block_hashes(NS, tokens(1000 + i, 3))
        store.writes.put(other, [data(h) for h in other], namespace_root=ROOT)
    assert store.reads.lookup(a_prompt).num_blocks == 20  # demoted, not lost
    clock.advance(2 * DAY_S + 4 * HOUR)  # Wed 15:00
    longer = block_hashes(NS, system + tokens(2, 10) + tokens(4, 3))
    store_turn(sm, "A", longer)
    assert sm.get("A").expires_at == clock.now() + 3 * DAY_S and sm.get("A").pinned
    wednesday = clock.now()
    clock.advance(3 * DAY_S + 60)  # Sat 15:01
    report = sm.sweep()
    assert report.expired_sessions == 1
    assert store.reads.meta(longer[0]).expires_at == wednesday + 7 * DAY_S  # type: ignore[union-attr]
    assert store.reads.lookup(longer).num_blocks == 10  # the shared system prompt only


class SlowSharedTier(CpuTier):
    """A shared tier whose ``locate_many`` (a network round trip) waits until released."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes, name="shared")
        self.entered = threading.Event()
        self.release = threading.Event()

    def corrupt_located(self) -> int:
        return 0

    def locate_many(self, hashes: Sequence[BlockHash]) -> list[None]:
        self.entered.set()
        self.release.wait(10)
        return [None] * len(hashes)

    def set_expiry_many(self, items: Sequence[tuple[BlockHash, float]]) -> None:
        pass


def test_a_lookup_waiting_on_the_shared_tier_holds_no_session_lock(clock: ManualClock):
    shared = SlowSharedTier(64 * SIZE)
    store = TieredStore([CpuTier(64 * SIZE), shared], clock=clock, default_ttl_s=HOUR)
    sm = SessionManager(store)
    sm.open("a")
    chain = block_hashes(NS, tokens(1, 4))
    store.writes.put(chain[:3], [data(h) for h in chain[:3]], namespace_root=ROOT)
    found: list[int] = []
    lookup = threading.Thread(target=lambda: found.append(sm.lookup("a", chain).num_blocks))
    lookup.start()
    try:
        assert shared.entered.wait(10)  # a local miss: the lookup asks the shared tier
        other = threading.Thread(target=lambda: (sm.open("b"), sm.close("a")))
        other.start()
        other.join(5)
        assert not other.is_alive()  # neither waited for the round trip
    finally:
        shared.release.set()
        lookup.join(10)
    # The lookup counts as before the close: its match stands, and it pins nothing for a
    # session that is gone (nothing would ever unpin it).
    assert found == [3]
    assert sm.pinned_sessions() == [] and store.stats().pinned_blocks == 0


def forecasting(clock: ManualClock, **kw: bool) -> tuple[TieredStore, SessionManager]:
    """A store under the node's default eviction (the forecast), and sessions over it."""
    store = TieredStore(
        [CpuTier(64 * SIZE)], EvictionPolicy.named("forecast", 1), clock=clock, default_ttl_s=HOUR
    )
    return store, SessionManager(store, **kw)


def test_a_finished_turn_forecast_back_after_the_idle_timeout_releases_its_pins(
    clock: ManualClock,
):
    """A user reading a finished turn (``end_turn``: back in over an hour at the forecast's
    quantile) holds no pins for the idle timeout; a tool call (back in seconds) keeps them;
    one tenant's finish never unpins another's session; a hint's soft TTL still holds pins."""
    store, sm = forecasting(clock, pins_follow_forecast=True)  # 300 s idle timeout
    sm.open("reader", tenant="alice")
    sm.open("looper", tenant="bob")
    reader = block_hashes(NS, tokens(1, 4))
    looper = block_hashes(NS, tokens(2, 4))
    for tenant, sid, chain in (("alice", "reader", reader), ("bob", "looper", looper)):
        match = sm.lookup(sid, chain, tenant=tenant)
        put_in_session(sm, sid, chain, [data(h) for h in chain], namespace_root=ROOT, tenant=tenant)
        assert match.num_blocks == 0
    assert store.stats().pinned_blocks == 8
    sm.record("looper", tenant="bob", finish_reason="tool_use")
    sm.record("reader", tenant="alice", finish_reason="end_turn")
    assert sm.pinned_sessions() == [("bob", "looper")]
    assert store.stats().pinned_blocks == 4 and not sm.get("reader", tenant="alice").pinned
    # the next turn pins again; a soft TTL holds the pins past a finished turn
    sm.hint("reader", Hint(ttl_s=HOUR), tenant="alice")
    sm.lookup("reader", reader, tenant="alice")
    sm.record("reader", tenant="alice", finish_reason="end_turn")
    assert ("alice", "reader") in sm.pinned_sessions()
    # off (the default): pins are held the idle timeout past every request
    _, held = forecasting(clock)
    held.open("reader")
    put_in_session(held, "reader", reader, [data(h) for h in reader], namespace_root=ROOT)
    held.record("reader", finish_reason="end_turn")
    assert held.pinned_sessions() == [("default", "reader")]
