"""Eviction by hit density (``Forecast`` mode ``chance``) over histograms of the gaps: the pure
parts, and the order it gives sessions of two tenants sharing one tier."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sessioncache.clock import ManualClock
from sessioncache.errors import InvalidInput
from sessioncache.hashing import BlockHash, Namespace, block_hashes
from sessioncache.sessions.hints import Hint
from sessioncache.sessions.manager import SessionManager
from sessioncache.store import TieredStore
from sessioncache.store.eviction import EvictionPolicy
from sessioncache.store.forecast import (
    CLASSES,
    DEFAULT_PRIORS,
    FLIGHT,
    HIST_EDGES,
    POOLED,
    Distribution,
    Forecast,
    Hist,
    fit_gap,
    fit_hist,
    hit_density,
)
from sessioncache.tiers.cpu import CpuTier
from tests.support.session_store import session_turn

SIZE = 64
NS = Namespace("m", 4, "bf16", "x")
ROOT = NS.root()
# Tool calls: nearly all back within seconds. Finished turns: spread from a minute to a day.
TOOL = fit_hist([5.0] * 99, 100)
STOP = fit_hist([60.0 * 2**k for k in range(10)] * 9, 100)


def chain(seed: int, blocks: int) -> list[BlockHash]:
    tokens = [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, blocks * 4)]
    return block_hashes(NS, tokens)


def data(h: bytes) -> bytes:
    return (h * 4)[:SIZE]


def priors() -> dict[str, Distribution]:
    out: dict[str, Distribution] = dict(DEFAULT_PRIORS)
    out.update(tool=TOOL, stop=STOP)
    return out


def make(blocks: int, clock: ManualClock, **options: object) -> tuple[TieredStore, SessionManager]:
    forecast = Forecast(mode="chance", priors=priors(), dead_branch_s=None, **options)  # type: ignore[arg-type]
    store = TieredStore(
        [CpuTier(blocks * SIZE)], EvictionPolicy(1, forecast), clock=clock, default_ttl_s=1e6
    )
    return store, SessionManager(store, pin_share=0.0)  # the order under test, not the pins'


def turn(
    sm: SessionManager, sid: str, hashes: list[BlockHash], tenant: str, finish: str | None
) -> None:
    session_turn(sm, sid, hashes, data, namespace_root=ROOT, tenant=tenant, finish_reason=finish)


def held(store: TieredStore, hashes: list[BlockHash]) -> int:
    return sum(store.reads.contains_many(hashes))


def fill(store: TieredStore, seed: int, blocks: int) -> None:
    more = chain(seed, blocks)
    store.writes.put(more, [data(h) for h in more], namespace_root=ROOT)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


# -- the pure parts ------------------------------------------------------------------------


def test_a_histogram_keeps_the_tail_that_a_log_normal_thins():
    gaps = [10.0] * 95 + [3600.0] * 5  # tool calls; a few an hour late
    hist, log_normal = fit_hist(gaps, 100), fit_gap(gaps, 100)
    # Silent for ten minutes: the late ones are all that is left, and they come back.
    assert hist.returns_within(600, 7200) > 0.9
    assert log_normal.returns_within(600, 7200) < hist.returns_within(600, 7200)
    assert hist.p == pytest.approx(100 / 101, abs=0.01)  # every one came back (smoothed)
    assert hist.survival(0) == 1.0 and hist.survival(1e9) == pytest.approx(1 - hist.p)
    back = hist.quantile(0.5)
    assert back is not None and hist.survival(back) == pytest.approx(0.5, abs=1e-9)
    assert hist.quantile(0.999) is None  # less likely than that ever to come back
    assert 9 < hist.median() < 11


def test_a_histogram_is_checked():
    with pytest.raises(InvalidInput):
        fit_hist([1.0, 2.0], 1)  # more gaps than events
    with pytest.raises(InvalidInput):
        Hist((0.5,) * (len(HIST_EDGES) - 1))
    with pytest.raises(InvalidInput):
        Hist((0.5, 0.6, *(0.4,) * (len(HIST_EDGES) - 2)))  # survival rising
    with pytest.raises(InvalidInput):  # a class key needs the class prior itself
        Forecast(mode="chance", shrink=4.0)
    with pytest.raises(InvalidInput):  # cold dates need log-normals
        Forecast(mode="value", priors=priors())


def test_hit_density_favours_the_sooner_and_falls_with_silence():
    horizon = 600.0
    assert hit_density(TOOL, 1, horizon) > hit_density(STOP, 1, horizon)
    # A tool call silent an hour is as good as gone; a finished turn then is still expected.
    assert hit_density(TOOL, 3600, horizon) < hit_density(STOP, 3600, horizon)
    densities = [hit_density(STOP, s, horizon) for s in (1, 60, 600, 3600, 36000)]
    assert densities == sorted(densities, reverse=True)


# -- the order -----------------------------------------------------------------------------


@pytest.mark.parametrize(("silence", "kept"), [(3600.0, "turn"), (1.0, "tool")])
def test_a_tool_call_outlasts_a_finished_turn_for_seconds_not_for_an_hour(
    clock: ManualClock, silence: float, kept: str
):
    """The forecast's ``next_use`` mode values both alike once they are overdue (by their
    silence, and then least recently used first); their distributions do not: an hour after
    a tool call it is not coming back, an hour after a finished turn its user may well be."""
    store, sm = make(12, clock)
    sm.open("tool", tenant="alice")
    sm.open("turn", tenant="bob")
    chains = {"turn": chain(2, 5), "tool": chain(1, 5)}
    turn(sm, "turn", chains["turn"], "bob", "end_turn")  # first: least recently used
    turn(sm, "tool", chains["tool"], "alice", "tool_use")
    clock.advance(silence)
    fill(store, 3, 4)
    lost = "tool" if kept == "turn" else "turn"
    assert held(store, chains[kept]) == 5
    assert held(store, chains[lost]) < 5


def test_of_one_class_the_oldest_event_leaves_first(clock: ManualClock):
    store, sm = make(14, clock)
    chains = {sid: chain(seed, 4) for seed, sid in enumerate(("a", "b", "c"), start=1)}
    for sid, hashes in chains.items():
        sm.open(sid, tenant=sid)
        turn(sm, sid, hashes, sid, "end_turn")
        clock.advance(30)
    fill(store, 9, 4)  # two blocks too many
    assert [held(store, chains[sid]) for sid in "abc"] == [2, 4, 4]


def test_of_one_class_a_return_still_ahead_keeps_the_chain_nearest_it(clock: ManualClock):
    """Tool results come back ten seconds after the call: nine seconds on, a tool loop is
    a second from its read, and one called a second ago is nine seconds from it. Of one
    class, the density rises with silence until the return is due, so the newest event
    leaves first there (and the oldest once the tail is heavy: the test above), whatever
    other classes hold the tier too."""
    soon = fit_hist([1.0] * 99, 100)
    forecast = Forecast(
        mode="chance",
        # a finished turn and blocks no session names (the filler) are read again at once
        priors={**priors(), "tool": fit_hist([10.0] * 99, 100), "stop": soon, POOLED: soon},
        dead_branch_s=None,
        stopping=True,
    )
    store = TieredStore(
        [CpuTier(16 * SIZE)], EvictionPolicy(1, forecast), clock=clock, default_ttl_s=1e6
    )
    sm = SessionManager(store, pin_share=0.0)
    chains = {"due": chain(1, 5), "called": chain(2, 5), "turn": chain(3, 2)}
    for sid, tenant, finish, wait in (
        ("due", "alice", "tool_use", 8.0),
        ("called", "bob", "tool_use", 0.5),
        ("turn", "carol", "end_turn", 0.5),
    ):
        sm.open(sid, tenant=tenant)
        turn(sm, sid, chains[sid], tenant, finish)
        clock.advance(wait)  # "due" called 9 s ago, "called" 1 s ago
    fill(store, 4, 6)  # two blocks too many
    assert [held(store, chains[sid]) for sid in ("due", "called", "turn")] == [5, 3, 2]


def test_a_block_no_session_files_is_valued_by_the_pooled_gap(clock: ManualClock):
    store, sm = make(12, clock)
    sm.open("s", tenant="alice")
    plain, mine = chain(1, 4), chain(2, 4)
    store.writes.put(plain, [data(h) for h in plain], namespace_root=ROOT)
    clock.advance(86400)  # a day silent, no session
    turn(sm, "s", mine, "alice", "tool_use")
    clock.advance(1)
    fill(store, 3, 6)
    assert held(store, mine) == 4
    assert held(store, plain) < 4


def test_a_hint_dates_the_chain_and_a_passed_date_recedes(clock: ManualClock):
    store, sm = make(12, clock)
    sm.open("hinted", tenant="alice")
    sm.open("turn", tenant="bob")
    hinted, done = chain(1, 5), chain(2, 5)
    turn(sm, "hinted", hinted, "alice", "end_turn")
    sm.hint("hinted", Hint(back_in_s=20.0), tenant="alice")
    turn(sm, "turn", done, "bob", "end_turn")
    clock.advance(10)
    fill(store, 3, 4)
    assert held(store, hinted) == 5  # back in ten seconds, said its client
    assert held(store, done) < 5
    meta = store.reads.meta(hinted[-1])
    forecast = store.forecast
    assert meta is not None and forecast is not None
    soon = forecast.chance(meta.next_use, meta.last_access, clock.now())
    late = forecast.chance(meta.next_use, meta.last_access, clock.now() + 86400)
    assert late < soon  # a day past the date it gave: an average silence of a day


@pytest.mark.parametrize(("stopping", "kept"), [(True, "loop"), (False, "dated")])
def test_a_tool_loop_is_worth_the_wait_that_pays_not_its_whole_tail(
    clock: ManualClock, stopping: bool, kept: str
):
    """Nine tool calls in ten come back in seconds, the tenth after the tier's horizon.
    Valued over the whole horizon, the tenth's wait makes the loop's chain worth less than
    one whose client says it is back in a hundred seconds; valued at the best point to let
    it go (``stopping``), the loop is worth its seconds' wait and keeps its chain."""
    tailed = fit_hist([5.0] * 90 + [3000.0] * 10, 100)
    forecast = Forecast(
        mode="chance",
        priors={**priors(), "tool": tailed},
        dead_branch_s=None,
        horizon_s=2700.0,
        stopping=stopping,
    )
    store = TieredStore(
        [CpuTier(12 * SIZE)], EvictionPolicy(1, forecast), clock=clock, default_ttl_s=1e6
    )
    sm = SessionManager(store, pin_share=0.0)
    sm.open("dated", tenant="bob")
    sm.open("loop", tenant="alice")
    chains = {"dated": chain(2, 5), "loop": chain(1, 5)}
    turn(sm, "dated", chains["dated"], "bob", "end_turn")
    sm.hint("dated", Hint(back_in_s=100.0), tenant="bob")
    turn(sm, "loop", chains["loop"], "alice", "tool_use")
    clock.advance(1)
    fill(store, 3, 4)
    lost = "dated" if kept == "loop" else "loop"
    assert held(store, chains[kept]) == 5
    assert held(store, chains[lost]) < 5


def test_stopping_is_the_best_density_up_to_the_horizon():
    for gap in (TOOL, STOP, fit_hist([5.0] * 90 + [3000.0] * 10, 100)):
        for silent in (1.0, 60.0, 3600.0):
            plain = hit_density(gap, silent, 2700.0)
            best = hit_density(gap, silent, 2700.0, stopping=True)
            assert best >= plain * (1 - 1e-9)
            assert best >= hit_density(gap, silent, 60.0) * (1 - 1e-2)


def test_a_priority_scales_how_soon_a_chain_is_expected(clock: ManualClock):
    store, sm = make(40, clock)
    forecast = store.forecast
    assert forecast is not None
    for sid, priority in (("high", 90), ("low", 10)):
        sm.open(sid, tenant=sid)
        turn(sm, sid, chain(len(sid), 4), sid, "end_turn")
        sm.hint(sid, Hint(priority=priority), tenant=sid)
    now = clock.now()
    high, low = (store.reads.meta(chain(len(s), 4)[-1]) for s in ("high", "low"))
    assert high is not None and low is not None
    assert forecast.chance(high.next_use, high.last_access, now) > forecast.chance(
        low.next_use, low.last_access, now
    )


def test_the_mode_runs_with_the_class_priors_alone():
    f = Forecast(mode="chance")
    assert len(f.classes) == 2 * len(CLASSES)
    key = f.event_key(True, FLIGHT, f.subagent_priors[FLIGHT], 5000.0)
    assert f.classes[f.class_of(key)] == (True, FLIGHT)
    assert 0 < f.chance(key, 5000.0, 5010.0) < math.inf
    assert f.priors[POOLED] is DEFAULT_PRIORS[POOLED]


def test_a_lower_tier_values_its_blocks_over_its_own_turnover(clock: ManualClock):
    """One tenant's chain comes back in a hundred seconds, surely; another's in ten seconds,
    one time in twenty. The memory tier turns over in half a minute: there, only the quick
    chance is worth anything. The disk tier below keeps a block for most of an hour, over
    which the sure return is worth more per second held, so the disk keeps that chain."""
    maybe = fit_hist([10.0] * 5, 100)
    sure = fit_hist([100.0] * 99, 100)
    forecast = Forecast(
        mode="chance",
        priors={**priors(), "tool": maybe, "stop": sure},
        dead_branch_s=None,
        stopping=True,
        horizon_s=30.0,
    )
    policy = EvictionPolicy(2, forecast)
    store = TieredStore(
        [CpuTier(2 * SIZE), CpuTier(10 * SIZE, name="disk")], policy, clock=clock, default_ttl_s=1e6
    )
    below = policy.horizons[1]
    assert policy.horizons[0] is forecast.horizon and below is not forecast.horizon
    below.seconds = below.rounded = 3000.0  # as its own victims would have it (next test)
    now = clock.now()
    assert forecast.chance(forecast.event_key(False, "stop", sure, now), now, now + 1) == 0.0
    sm = SessionManager(store, pin_share=0.0)
    sm.open("sure", tenant="bob")
    sm.open("maybe", tenant="alice")
    chains = {"sure": chain(2, 5), "maybe": chain(1, 5)}
    turn(sm, "sure", chains["sure"], "bob", "end_turn")
    turn(sm, "maybe", chains["maybe"], "alice", "tool_use")
    assert all(store.reads.where(h) == ["disk"] for h in chains["sure"])
    clock.advance(1)
    fill(store, 3, 4)  # two blocks must leave the disk tier
    assert held(store, chains["sure"]) == 5
    assert held(store, chains["maybe"]) == 3


def test_each_tier_counts_its_own_turnover(clock: ManualClock):
    """A block a second through a memory tier of 4 blocks over a disk tier of 32: the memory
    keeps a block about 4 s, the disk about 32 s more (Little's law on each tier's victims;
    a spare copy leaving the disk says nothing of it)."""
    policy = EvictionPolicy(2, Forecast(mode="chance", priors=priors(), horizon_s=600.0))
    store = TieredStore(
        [CpuTier(4 * SIZE), CpuTier(32 * SIZE, name="disk")], policy, clock=clock, default_ttl_s=1e6
    )
    for seed in range(400):
        fill(store, 100 + seed, 1)
        clock.advance(1)
    fast, slow = (h.seconds for h in policy.horizons)
    assert fast == pytest.approx(4.0, rel=0.2)
    assert slow == pytest.approx(32.0, rel=0.2)
