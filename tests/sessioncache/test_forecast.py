"""Session-aware eviction: the forecast's pure parts, the policy's order under it, and the
signals sessions feed it (two tenants sharing one tier)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sessioncache.clock import ManualClock
from sessioncache.errors import InvalidInput, SessionNotFound
from sessioncache.hashing import BlockHash, Namespace, block_hashes
from sessioncache.sessions.manager import SessionManager
from sessioncache.store import TieredStore
from sessioncache.store.eviction import EvictionPolicy
from sessioncache.store.forecast import (
    FLIGHT,
    NO_FORECAST,
    ORPHAN_BASE,
    POOLED,
    Forecast,
    Gap,
    Horizon,
    Rhythm,
    cold_after,
    eviction_value,
    finish_class,
    fit_gap,
)
from sessioncache.tiers.cpu import CpuTier
from tests.support.session_store import session_turn

SIZE = 64
NS = Namespace("m", 4, "bf16", "x")
ROOT = NS.root()
FORECAST = Forecast()


def chain(seed: int, blocks: int) -> list[BlockHash]:
    tokens = [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, blocks * 4)]
    return block_hashes(NS, tokens)


def data(h: bytes) -> bytes:
    return (h * 4)[:SIZE]


def make(
    blocks: int, clock: ManualClock, policy: str = "forecast"
) -> tuple[TieredStore, SessionManager]:
    # The ``next_use`` mode (a setting; the node's default, ``chance``: test_chance.py).
    chosen = (
        EvictionPolicy(1, Forecast()) if policy == "forecast" else EvictionPolicy.named(policy, 1)
    )
    store = TieredStore([CpuTier(blocks * SIZE)], chosen, clock=clock, default_ttl_s=1e5)
    # Pins off: the order under test is the eviction policy's, not the pins'.
    return store, SessionManager(store, pin_share=0.0)


def turn(
    sm: SessionManager,
    sid: str,
    hashes: list[BlockHash],
    *,
    tenant: str = "default",
    finish: str | None = None,
) -> None:
    session_turn(sm, sid, hashes, data, namespace_root=ROOT, tenant=tenant, finish_reason=finish)


def held(store: TieredStore, hashes: list[BlockHash]) -> int:
    return sum(store.reads.contains_many(hashes))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


# -- the pure parts ------------------------------------------------------------------------


def test_a_gap_is_a_log_normal_with_a_mass_at_never():
    g = Gap(0.8, math.log(10.0), 1.0)
    assert g.survival(0.0) == 1.0
    assert g.survival(10.0) == pytest.approx(1 - 0.8 * 0.5)  # half of those who return
    assert g.survival(1e9) == pytest.approx(0.2)  # those who never do
    assert g.median() == pytest.approx(10.0)
    # Conditional on silence, the return within a horizon falls once past the bulk.
    assert g.returns_within(0.0, 60.0) > g.returns_within(300.0, 60.0) > 0
    assert g.returns_within(1e7, 60.0) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(InvalidInput):
        Gap(0.0, 1.0, 1.0)


def test_fit_gap_recovers_the_parameters():
    rng = np.random.default_rng(0)
    gaps = list(np.exp(rng.normal(3.0, 1.5, 4000)))
    g = fit_gap(gaps, 5000)  # a fifth never came back
    assert g.p == pytest.approx(0.8, abs=1e-3)
    assert g.mu == pytest.approx(3.0, abs=0.1)
    assert g.sigma == pytest.approx(1.5, abs=0.1)


def test_a_rhythm_shrinks_its_own_gaps_toward_the_class_prior():
    f = Forecast(shrink=4.0)
    r = Rhythm()
    r.arrive(100.0)
    assert r.gap(f, FLIGHT) == f.priors[FLIGHT]  # nothing of its own yet
    for t in (200.0, 300.0, 400.0, 500.0):  # four 1-second tool round trips
        r.finished_with("tool", t)
        r.arrive(t + 1.0)
    own = r.gap(f, "tool")
    prior = f.priors["tool"]
    assert own.mu == pytest.approx((4 * prior.mu + 4 * math.log(1.0)) / 8)  # halfway
    assert Rhythm(parent=("t", "p")).gap(f, "stop") == f.subagent_priors["stop"]
    assert Rhythm().gap(Forecast(shrink=math.inf), "tool") == prior


def test_cold_dates_order_classes_and_reduce_to_lru_for_the_pooled_prior():
    f = Forecast(mode="value")
    tool, stop = f.cold_key(f.priors["tool"], 0.0), f.cold_key(f.priors["stop"], 0.0)
    assert tool != stop
    h = f.horizon.seconds
    # A session no better known than the average block is cold at about the horizon's age,
    # as a block no session names (LRU) is.
    pooled = -f.cold_key(f.priors[POOLED], 0.0)
    assert pooled == pytest.approx(f.lru_cold(0.0), rel=0.05)
    assert f.lru_cold(0.0) == pytest.approx(h)
    never = Gap(0.01, 3.0, 1.0)  # all but never back: cold at once
    assert cold_after(never, h, f.level()) <= 0
    # The value: a key where there is one, else the LRU cold date (the larger goes first).
    assert eviction_value(-50.0, 0.0, f) == -50.0
    assert eviction_value(NO_FORECAST, 10.0, f) > eviction_value(NO_FORECAST, 20.0, f)
    assert ORPHAN_BASE - 2e9 > 1e14  # a dead branch's key: above any forecast


def test_a_quantile_is_a_next_use_and_a_session_unlikely_back_has_none():
    g = Gap(0.8, math.log(10.0), 1.0)
    assert g.quantile(0.4) == pytest.approx(10.0)  # half of the 80% who return
    assert Gap(0.4, 1.0, 1.0).quantile(0.5) is None  # more likely never back
    f = Forecast(mode="next_use", quantile=0.5)
    assert f.cold_key(f.priors["tool"], 100.0) == pytest.approx(100.0 + f.gaps["tool"])
    assert f.cold_key(Gap(0.1, 1.0, 1.0), 100.0) == ORPHAN_BASE - 100.0  # dead
    # The value recedes once the return is overdue (LRU's order without forecasts).
    assert f.value(130.0, 100.0, 105.0) == 130.0
    assert f.value(130.0, 100.0, 140.0) == 140.0 + f.overdue * 40.0
    assert f.value(NO_FORECAST, 0.0, 50.0) > f.value(NO_FORECAST, 10.0, 50.0)


def test_a_return_beyond_the_horizon_counts_as_one_horizon_ahead_only():
    f = Forecast(mode="next_use", beyond=2.0)
    f.horizon.seconds = 100.0
    assert f.value(130.0, 100.0, 105.0) == 130.0  # within two horizons: its date
    assert f.value(900.0, 100.0, 105.0) == 105.0 + 200.0  # further: two horizons ahead
    assert f.value(ORPHAN_BASE - 100.0, 100.0, 105.0) == 305.0  # never back: the same
    # so among them the overdue term decides: the least recently used goes first
    assert f.value(900.0, 0.0, 105.0) == 105.0 + f.overdue * 105.0
    assert f.value(NO_FORECAST, 0.0, 50.0) == 50.0 + f.overdue * 50.0
    uncapped = Forecast(mode="next_use", beyond=math.inf)
    assert uncapped.value(ORPHAN_BASE - 100.0, 100.0, 105.0) == ORPHAN_BASE - 100.0
    with pytest.raises(InvalidInput):
        Forecast(beyond=0.0)


def test_the_node_caps_at_one_horizon_and_the_predicted_date_is_never_capped():
    f = Forecast()  # the node's default: the setting cross-validation chose
    assert f.mode == "next_use" and f.beyond == 1.0
    f.horizon.seconds = 100.0
    # Two returns past the cap tie for eviction, but their dates still order them (what the
    # prefetch engine ranks chains by).
    assert f.value(900.0, 100.0, 105.0) == f.value(5000.0, 100.0, 105.0) == 205.0
    assert f.predicted(900.0, 100.0, 105.0) == 900.0
    assert f.predicted(5000.0, 100.0, 105.0) == 5000.0
    assert f.predicted(130.0, 100.0, 140.0) == f.value(130.0, 100.0, 140.0)  # overdue alike


def test_the_horizon_is_the_tiers_turnover():
    h = Horizon(600.0, level=0.5)
    for t in range(1, 11):  # a 16,000-byte tier loses 100 bytes a second
        h.evicted(100, float(t), 16_000, None)
    # A sixteenth of the tier went in 9 s: the whole of it goes in 144 s (smoothed).
    assert h.seconds == pytest.approx(600.0 + 0.25 * (144.0 - 600.0))
    h.evicted(100, 11.0, 16_000, early=5.0)  # a victim taken before its cold date
    assert h.level > 0.5
    with pytest.raises(InvalidInput):
        Forecast(threshold=0.0)
    with pytest.raises(InvalidInput):
        Forecast(priors={"tool": Gap(1.0, 1.0, 1.0)})


def test_finish_reasons_of_each_vocabulary_and_a_bad_one():
    assert {finish_class(r) for r in ("tool_use", "tool_calls", "function_call")} == {"tool"}
    assert {finish_class(r) for r in ("stop", "end_turn", "stop_sequence")} == {"stop"}
    assert finish_class("max_tokens") == finish_class("length") == "length"
    with pytest.raises(InvalidInput, match="finish reasons are"):
        finish_class("whatever")
    with pytest.raises(InvalidInput):
        finish_class(3)  # type: ignore[arg-type]


# -- the policy under a forecast -----------------------------------------------------------


def test_the_tail_expected_back_last_leaves_first_not_the_least_recent(clock: ManualClock):
    store, sm = make(12, clock)
    sm.open("loop")
    sm.open("done")
    loop, done = chain(1, 5), chain(2, 5)
    turn(sm, "loop", loop, finish="tool_use")  # back in seconds
    clock.advance(1)
    turn(sm, "done", done, finish="end_turn")  # more recent, but back in minutes
    clock.advance(1)
    turn(sm, "loop", loop + chain(3, 2), finish="tool_use")
    clock.advance(1)
    store.writes.put(chain(4, 2), [data(h) for h in chain(4, 2)], namespace_root=ROOT)
    assert held(store, loop) == 5  # the tool loop kept its whole chain
    assert held(store, done) < 5  # the finished turn gave up its tail


def test_lru_setting_keeps_todays_order(clock: ManualClock):
    store, sm = make(12, clock, policy="lru")
    assert store.forecast is None
    sm.open("loop")
    sm.open("done")
    loop, done = chain(1, 5), chain(2, 5)
    turn(sm, "loop", loop, finish="tool_use")
    clock.advance(1)
    turn(sm, "done", done, finish="end_turn")
    clock.advance(60)
    more = chain(4, 4)
    store.writes.put(more, [data(h) for h in more], namespace_root=ROOT)
    assert held(store, loop) < 5  # least recently used goes, whatever the finish said
    assert held(store, done) == 5


def test_a_finish_moves_a_forecast_further_and_the_tail_is_refiled(clock: ManualClock):
    store, sm = make(10, clock)
    sm.open("a")
    sm.open("b")
    a, b = chain(1, 5), chain(2, 5)
    turn(sm, "b", b)  # running: expected back in a request's length
    clock.advance(1)
    turn(sm, "a", a)
    before = store.reads.meta(b[-1])
    f = store.forecast
    assert f is not None
    assert before is not None and before.next_use == f.cold_key(f.priors[FLIGHT], 1000.0)
    sm.record("b", finish_reason="end_turn")  # b's turn ended: minutes away, if ever
    after = store.reads.meta(b[-1])
    assert after is not None and after.next_use == f.cold_key(f.priors["stop"], 1001.0)
    assert after.next_use > before.next_use  # colder sooner than a running request
    clock.advance(1)
    more = chain(3, 2)
    store.writes.put(more, [data(h) for h in more], namespace_root=ROOT)
    assert held(store, b) == 3 and held(store, a) == 5


def test_a_prompt_that_left_its_previous_chain_gives_up_the_old_branch_first(
    clock: ManualClock,
):
    store, sm = make(12, clock)
    sm.open("s")
    sm.open("t")
    base, branch = chain(1, 3), chain(2, 3)
    turn(sm, "s", base + branch, finish="tool_use")
    clock.advance(1)
    turn(sm, "t", chain(5, 4))  # running, older than s's last turn
    clock.advance(1)
    turn(sm, "s", base + chain(3, 2), finish="tool_use")  # edited history: branch is dead
    assert held(store, branch) == 3
    meta = store.reads.meta(branch[-1])  # back in an hour, if ever: after the live sessions
    assert meta is not None and meta.next_use == FORECAST.dead_branch_key(clock.now())
    clock.advance(1)
    more = chain(4, 3)
    store.writes.put(more, [data(h) for h in more], namespace_root=ROOT)
    assert held(store, branch) == 0  # the dead branch went, not the live sessions
    assert held(store, chain(5, 4)) == 4


def test_a_closed_subagent_gives_up_its_own_blocks_not_its_parents(clock: ManualClock):
    store, sm = make(20, clock)
    sm.open("main")
    sm.open("main:sub", parent="main")
    prefix = chain(1, 4)
    turn(sm, "main", prefix, finish="tool_use")
    sub = prefix + chain(2, 3)
    turn(sm, "main:sub", sub, finish="end_turn")
    sm.close("main:sub")
    own = store.reads.meta(sub[-1])
    shared = store.reads.meta(prefix[-1])
    assert own is not None and own.next_use > 1e14
    assert shared is not None and shared.next_use < 1e14


def test_a_closed_chain_waits_behind_blocks_silent_longer_than_the_horizon(clock: ManualClock):
    def evicted_first(beyond: float) -> str:
        f = Forecast(beyond=beyond)
        store = TieredStore(
            [CpuTier(12 * SIZE)], EvictionPolicy(1, f), clock=clock, default_ttl_s=1e5
        )
        sm = SessionManager(store, pin_share=0.0)
        plain = chain(5, 4)
        store.writes.put(plain, [data(h) for h in plain], namespace_root=ROOT)  # no session
        clock.advance(f.horizon.seconds)  # silent for a whole horizon
        sm.open("done")
        done = chain(2, 4)
        turn(sm, "done", done, finish="end_turn")
        sm.close("done")  # never back: no cap, its blocks leave before any other
        more = chain(4, 6)
        store.writes.put(more, [data(h) for h in more], namespace_root=ROOT)
        return "plain" if held(store, plain) < 4 else "done" if held(store, done) < 4 else ""

    assert evicted_first(math.inf) == "done"
    # capped at one horizon ahead: the block silent for a horizon (valued at overdue
    # horizons ahead) goes before it
    assert evicted_first(1.0) == "plain"


def test_one_tenant_cannot_move_another_tenants_forecast(clock: ManualClock):
    store, sm = make(20, clock)
    sm.open("s", tenant="alice")
    mine = chain(1, 4)
    turn(sm, "s", mine, tenant="alice", finish="tool_use")
    before = store.reads.meta(mine[-1])
    assert before is not None
    value = before.next_use
    with pytest.raises(SessionNotFound):
        sm.record("s", tenant="mallory", finish_reason="end_turn")
    with pytest.raises(SessionNotFound):
        sm.close("s", tenant="mallory")
    with pytest.raises(InvalidInput):
        sm.record("s", tenant="alice", finish_reason="not-a-reason")
    after = store.reads.meta(mine[-1])
    assert after is not None and after.next_use == value


def test_the_pin_budget_unpins_the_session_expected_back_last(clock: ManualClock):
    store = TieredStore(
        [CpuTier(10 * SIZE)], EvictionPolicy.named("forecast", 1), clock=clock, default_ttl_s=1e5
    )
    sm = SessionManager(store, pin_share=0.5)  # 5 blocks of pins
    for sid in ("loop", "done", "new"):
        sm.open(sid)
    turn(sm, "loop", chain(1, 2), finish="tool_use")  # least recently active, back soonest
    clock.advance(1)
    turn(sm, "done", chain(2, 2), finish="end_turn")
    clock.advance(1)
    turn(sm, "new", chain(3, 2))  # 6 blocks pinned: one session's pins must go
    assert set(sm.pinned_sessions()) == {("default", "loop"), ("default", "new")}


def test_a_dead_branch_is_filed_at_every_tail_it_has_in_a_tier(clock: ManualClock):
    store = TieredStore(
        [CpuTier(8 * SIZE, name="fast"), CpuTier(8 * SIZE, name="slow")],
        EvictionPolicy.named("forecast", 2),
        clock=clock,
        default_ttl_s=1e5,
    )
    a, b, c = chain(1, 3)
    store.writes.put([a, b, c], [data(h) for h in (a, b, c)], namespace_root=ROOT, tier="slow")
    x = chain(2, 1)
    store.writes.put(x, [data(x[0])], namespace_root=ROOT, tier="fast")
    clock.advance(1)
    store.reads.get(a)  # promoted: a and c are held fast, b only below: two tails up there
    store.reads.get(c)
    store.reads.forecast([a, b, c], None)  # a dead branch: before anything with a forecast
    core = store._core
    order: list[BlockHash] = []
    while len(order) < 3:  # nothing leaves here: a block's other entries come up again
        victim = core.policy.next_victim(0, clock.now(), core.index.get)
        assert victim is not None
        if victim.block_hash not in order:
            order.append(victim.block_hash)
    assert set(order[:2]) == {a, c} and order[2] == x[0]


def test_a_dead_branch_spares_what_another_branch_forks_from(clock: ManualClock):
    store, sm = make(30, clock)
    sm.open("s")
    sm.open("t")
    base, old, other = chain(1, 3), chain(2, 3), chain(3, 2)
    turn(sm, "s", base + old)
    turn(sm, "t", base + old[:1] + other)  # t forks off s's branch after its first block
    turn(sm, "s", base + chain(4, 2))  # s leaves its branch
    dead = FORECAST.dead_branch_key(clock.now())
    assert next_uses(store, old[1:]) == [dead, dead]  # only s's own, past t's fork
    assert dead not in next_uses(store, base + old[:1] + other)


def next_uses(store: TieredStore, hashes: list[BlockHash]) -> list[float]:
    metas = [store.reads.meta(h) for h in hashes]
    return [m.next_use for m in metas if m is not None]


def test_the_value_mode_evicts_the_block_cold_first_and_keyless_ones_by_lru(clock: ManualClock):
    f = Forecast(mode="value")
    store = TieredStore([CpuTier(8 * SIZE)], EvictionPolicy(1, f), clock=clock, default_ttl_s=1e5)
    sm = SessionManager(store, pin_share=0.0)
    sm.open("done")
    done = chain(2, 4)
    turn(sm, "done", done, finish="end_turn")  # cold within seconds at this horizon
    plain = chain(5, 4)
    store.writes.put(plain, [data(h) for h in plain], namespace_root=ROOT)  # no session: LRU
    meta = store.reads.meta(done[-1])
    assert meta is not None and meta.next_use == f.cold_key(f.priors["stop"], clock.now())
    clock.advance(f.horizon.seconds / 2)
    more = chain(4, 4)
    store.writes.put(more, [data(h) for h in more], namespace_root=ROOT)
    # the finished turn is cold before an LRU block of its age: its tail went first
    assert held(store, plain) == 4 and held(store, done) == 0
