"""Trace replay on hand-written fixtures: loading, hand-computed hit rates, the CLI's JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from sessioncache.commands import replay as replay_command
from sessioncache.errors import InvalidInput
from sessioncache.node import OPEN_TENANT
from sessioncache.replay.runner import (
    POLICIES,
    make_simulator,
    parse_tiers,
    replay_one,
    run_replay,
    split_capacity,
)
from sessioncache.replay.simulators import CLOCK_START, LruSim, OracleSim, StoreSim
from sessioncache.replay.trace import Request, Trace, load_trace
from sessioncache.store.eviction import EvictionPolicy

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "traces"
AGENT = FIXTURES / "agent-sessions"
JSONL = FIXTURES / "tiny.jsonl"

# tiny.jsonl by hand (512-token blocks): tokens 1200 + 1100 + 700 + 1536 + 1000 = 5536.
# Oracle: r2 hits [1, 2] (1024), r3 [1] (512), r4 [1, 2, 3] (1536), r5 [1, 2] -> min(1024, 1000).
JSONL_TOKENS = 5536
JSONL_ORACLE_HITS = 0 + 1024 + 512 + 1536 + 1000
# Plain LRU of 3 blocks touching each request root first (LRU -> MRU):
#   r1 [1,2,3] miss           -> 1 2 3
#   r2 [1,2,4] hits 1,2       -> 1 2 4    (3 evicted)
#   r3 [1,5]   hits 1         -> 2 4 1 -> 4 1 5
#   r4 [1,2,3] hits 1         -> 4 5 1 -> 1 2 3
#   r5 [1,2]   hits 1,2 (1000 tokens: the second block is partial)
JSONL_LRU_HITS = 0 + 1024 + 512 + 512 + 1000
# The same LRU touching deepest first: r4 then hits [1, 2].
JSONL_LRU_TAIL_FIRST_HITS = 0 + 1024 + 512 + 1024 + 1000

# agent-sessions by hand (64-token blocks; each file its own id space, so start times do not
# matter to the oracle): a: 192 + 128 (subagent) + 256 of 1300; b: 448 + 128 of 1150;
# c: 64 of 164.
AGENT_TOKENS = 1300 + 1150 + 164
AGENT_ORACLE_HITS = 576 + 576 + 64


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sessioncache")
    sub = parser.add_subparsers(dest="command", required=True)
    replay_command.register(sub)
    return parser.parse_args(["replay", *argv])


def _run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    args = _args(*argv, "--json", "--no-progress")
    assert args.func(args) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_jsonl_loads_in_order_with_seconds_and_512_token_blocks():
    trace = load_trace(JSONL)
    assert trace.kind == "mooncake" and trace.block_tokens == 512
    assert [r.time for r in trace.requests] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert all(r.session is None for r in trace.requests)
    assert trace.unique_blocks == 5 and trace.total_tokens == JSONL_TOKENS


def test_session_folder_namespaces_files_and_times_subagents():
    trace = load_trace(AGENT, span_days=1, seed=3)
    assert trace.kind == "agent-sessions" and trace.block_tokens == 64
    assert trace.sessions == 4  # a, its subagent, b, c
    assert trace.unique_blocks == 9 + 8 + 1
    assert trace.total_tokens == AGENT_TOKENS
    times = [r.time for r in trace.requests]
    assert times == sorted(times) and all(0 <= t < 86400 + 4000 for t in times)
    by_session: dict[str | None, list[Request]] = {}
    for r in trace.requests:
        by_session.setdefault(r.session, []).append(r)
    a, sub = by_session["a"], by_session["a:agent_001"]
    start = a[0].time
    assert [r.time - start for r in a] == pytest.approx([0, 30, 4000])
    assert [r.time - start for r in sub] == pytest.approx([40, 45])
    # Equal local ids in different files are different blocks.
    assert not set(a[0].ids) & set(by_session["b"][0].ids)


def test_oracle_matches_the_hand_computed_rates():
    report = run_replay(load_trace(JSONL), capacity_frac=0.6, policies=["oracle"])
    assert report.results["oracle"].hit_tokens == JSONL_ORACLE_HITS
    assert report.hit_rates()["oracle"] == pytest.approx(JSONL_ORACLE_HITS / JSONL_TOKENS)
    report = run_replay(load_trace(AGENT), policies=["oracle"])
    assert report.results["oracle"].hit_tokens == AGENT_ORACLE_HITS
    assert report.results["oracle"].total_tokens == AGENT_TOKENS


def test_lru_matches_the_hand_computed_example():
    trace = load_trace(JSONL)
    report = run_replay(trace, capacity_frac=0.6, policies=["lru", "lru_tail_first"])
    assert report.capacity_blocks == 3
    assert report.results["lru"].hit_tokens == JSONL_LRU_HITS
    assert report.results["lru_tail_first"].hit_tokens == JSONL_LRU_TAIL_FIRST_HITS


# A trace to replay by hand: 100-token blocks, 9 unique blocks, capacity round(6/9 * 9) = 6
# blocks in one tier; 200 + 500 + 300 + 400 + 500 = 1900 input tokens. Session "a" grows one
# chain over three turns, the last one ten minutes after the previous; a session-less burst
# comes in between and again at the end.
HAND_TRACE = [
    Request(0.0, "a", (1, 2), 200),  # r1
    Request(10.0, None, (5, 6, 7, 8, 9), 500),  # r2
    Request(20.0, "a", (1, 2, 3), 300),  # r3
    Request(620.0, "a", (1, 2, 3, 4), 400),  # r4
    Request(630.0, None, (5, 6, 7, 8, 9), 500),  # r5
]
HAND_TOKENS = 1900
# (hit tokens, hit blocks) per policy, by hand:
#
# oracle: a block misses only the first time it is seen: r3 hits 1 2, r4 1 2 3, r5 5..9.
#
# lru, 6 blocks, each request touching root first (stack least recent first):
#   r1 miss                  -> 1 2
#   r2 miss; 9 evicts 1      -> 2 5 6 7 8 9
#   r3 1 is gone: miss; touching 1 2 3 evicts 2 5 6 -> 7 8 9 1 2 3
#   r4 hits 1 2 3; 4 evicts 7 -> 8 9 1 2 3 4
#   r5 5 is gone: miss
# ttl_5min: the same stack, but r4 comes 600 s after r3 last touched 1: expired, a miss (its
#   one expired lookup); nothing else hits.
# lru_tail_first, touching deepest first:
#   r1 -> 2 1;  r2: 5 evicts 2 -> 1 9 8 7 6 5
#   r3 hits 1 (2 is gone); touching 3 2 1 evicts 1 9 8 -> 7 6 5 3 2 1
#   r4 hits 1 2 3; 4 evicts 7 -> 6 5 4 3 2 1
#   r5 hits 5 6 (7 is gone)
# sessioncache (the production store and sessions): a live session's chain is pinned, within
# pin_share = half the tier (3 blocks); victims are unpinned chain tails, least recent first.
#   r1 miss; stores 1 2, a pins them.
#   r2 miss; stores 5 6 7 8. For 9 the one unpinned tail is 8, its parent, stored in the same
#      put: hotter than 9, so 9 is refused (dropped_on_put 1). Held: 1 2 5 6 7 8. (Without
#      the pins, 9 would evict 2, the coldest tail, and r3 would hit only 1.)
#   r3 hits 1 2; 3 evicts the coldest tail, 8. a pins 1 2 3 (3 blocks: within its share).
#   r4 the sweep at 600 s unpins a (idle 580 s > 300 s); nothing has expired (TTLs are days).
#      Hits 1 2 3; 4 evicts 7. Pinning 1 2 3 4 would pass the share: a's pins go.
#   r5 hits 5 6; 7 8 9 evict the coldest tails, 4, 3, 2. Evictions: 8 7 4 3 2 = 5.
HAND_HITS = {
    "oracle": (200 + 300 + 500, 2 + 3 + 5),
    "lru": (300, 3),
    "ttl_5min": (0, 0),
    "sessioncache": (200 + 300 + 200, 2 + 3 + 2),
    "lru_tail_first": (100 + 300 + 200, 1 + 3 + 2),
}


def test_every_policy_matches_the_hand_replayed_trace():
    trace = Trace("hand", "agent-sessions", 100, HAND_TRACE, 9, 1)
    assert len({b for r in HAND_TRACE for b in r.ids}) == trace.unique_blocks
    report = run_replay(trace, capacity_frac=6 / 9, policies=[*POLICIES, "lru_tail_first"])
    assert report.tiers == [("cpu", 6)]
    got = {name: (r.hit_tokens, r.hit_blocks) for name, r in report.results.items()}
    assert got == HAND_HITS
    assert {name: r.total_tokens for name, r in report.results.items()} == dict.fromkeys(
        HAND_HITS, HAND_TOKENS
    )
    assert report.hit_rates() == {name: hits / HAND_TOKENS for name, (hits, _) in HAND_HITS.items()}
    results = report.results
    assert results["sessioncache"].tier_hit_tokens == {"cpu": 700}
    assert results["lru"].tier_hit_tokens == {"cpu": 300}
    assert results["ttl_5min"].detail["expired_lookups"] == 1
    ours = results["sessioncache"].detail
    assert ours["dropped_on_put"] == 1 and ours["counters"]["evictions"] == 5
    assert ours["sweeps"] == 1 and ours["blocks_held"] == 6 and ours["sessions_open"] == 1


def test_ttl_expires_five_minutes_after_the_last_access():
    sim = LruSim("ttl", [("cpu", 100)], ttl_s=300.0)

    def at(t: float) -> int:
        return len(sim.serve(Request(t, None, (1, 2), 128)))

    assert [at(0), at(200), at(499), at(800), at(801)] == [0, 2, 2, 0, 2]


def test_two_tier_lru_is_one_stack_and_credits_the_tier_that_held_each_block():
    sim = LruSim("lru", [("cpu", 1), ("disk", 2)])
    assert sim.serve(Request(0, None, (1, 2, 3), 192)) == []
    # cpu holds 3 (most recent); disk holds 1, 2; a hit on the chain reads 1, 2 from disk.
    assert sim.serve(Request(1, None, (1, 2, 3), 192)) == [1, 1, 0]


def test_oracle_is_an_upper_bound_and_full_capacity_reaches_it():
    trace = load_trace(AGENT, span_days=0.01, seed=1)
    small = run_replay(trace, capacity_frac=0.3, tiers=parse_tiers("cpu:1,disk:2"))
    oracle = small.results["oracle"].hit_rate
    for result in small.results.values():
        assert 0.0 <= result.hit_rate <= oracle + 1e-12
        assert sum(result.tier_hit_tokens.values()) == result.hit_tokens
    full = run_replay(trace, capacity_frac=1.0, policies=["oracle", "lru", "sessioncache"])
    assert full.hit_rates()["lru"] == pytest.approx(oracle)
    assert full.hit_rates()["sessioncache"] == pytest.approx(oracle)


def test_store_sim_opens_a_session_per_file_and_subagent_and_sweeps():
    trace = load_trace(AGENT, span_days=1, seed=0)
    sim = StoreSim("sc", [("cpu", 64 * 100)], block_bytes=64, sweep_s=60.0)
    for request in trace.requests:
        sim.serve(request)
    detail = sim.detail()
    assert detail["sessions_open"] == 4
    assert detail["sweeps"] >= 1 and detail["dropped_on_put"] == 0
    assert sim.store.stats_tiers()[0].used_bytes == 64 * trace.unique_blocks
    sim.close()


def test_store_sim_serves_session_less_requests_through_the_store():
    trace = load_trace(JSONL)
    sim = StoreSim("sc", [("cpu", 512 * 3)], block_bytes=512)
    matched = [len(sim.serve(r)) for r in trace.requests]
    assert matched[1] == 2 and matched[-1] == 2
    assert sim.detail()["counters"]["evictions"] > 0


def test_split_capacity_and_tier_spec():
    assert parse_tiers("cpu:1,disk:16") == [("cpu", 1.0), ("disk", 16.0)]
    assert split_capacity(17, [("cpu", 1.0), ("disk", 16.0)]) == [("cpu", 1), ("disk", 16)]
    assert split_capacity(5, [("a", 1.0), ("b", 1.0)]) == [("a", 2), ("b", 3)]


def test_oracle_sim_reports_tier_zero():
    sim = OracleSim()
    sim.serve(Request(0, None, (1, 2), 10))
    assert sim.serve(Request(1, None, (1, 2, 3), 10)) == [0, 0]


def test_json_shape(capsys: pytest.CaptureFixture[str]):
    out = _run_json(capsys, str(AGENT), "--span-days", "0.5", "--capacity-frac", "0.3")
    for name in POLICIES:
        assert 0.0 <= out[name] <= 1.0
    assert out["oracle"] == pytest.approx(AGENT_ORACLE_HITS / AGENT_TOKENS)
    detail = out["detail"]
    assert detail["trace"]["unique_blocks"] == 18
    assert detail["capacity"]["blocks"] == round(0.3 * 18)
    assert set(detail["policies"]) >= set(POLICIES)
    assert set(detail["policies"]["sessioncache"]["tier_hit_rates"]) == {"cpu"}


def test_same_seed_same_numbers(capsys: pytest.CaptureFixture[str]):
    argv = (str(AGENT), "--span-days", "0.01", "--capacity-frac", "0.4", "--seed", "7")
    first = _run_json(capsys, *argv)
    second = _run_json(capsys, *argv)
    assert {k: first[k] for k in POLICIES} == {k: second[k] for k in POLICIES}
    a = load_trace(AGENT, span_days=3, seed=7)
    b = load_trace(AGENT, span_days=3, seed=7)
    c = load_trace(AGENT, span_days=3, seed=8)
    assert a.requests == b.requests and a.requests != c.requests


def test_text_report_and_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    # matplotlib is in the dev extra, so CI runs this test rather than skipping it.
    png = tmp_path / "hit.png"
    args = _args(
        str(JSONL),
        "--capacity-frac",
        "0.6",
        "--plot",
        str(png),
        "--plot-fracs",
        "0.2,1.0",
        "--no-progress",
        "--extra",
        "lru_tail_first,belady",
    )
    assert args.func(args) == 0
    text = capsys.readouterr().out
    for name in (*POLICIES, "belady"):
        assert name in text
    assert "target:" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_is_an_error_not_a_traceback(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    args = _args(str(tmp_path / "missing.jsonl"), "--no-progress")
    assert args.func(args) == 2
    assert "no trace" in capsys.readouterr().err
    args = _args(str(JSONL), "--tiers", "cpu:0", "--no-progress")
    assert args.func(args) == 2


def test_empty_trace_object_has_no_requests():
    trace = Trace("empty", "mooncake", 512, [], 0, 0)
    assert trace.total_tokens == 0 and trace.total_blocks == 0


def test_misses_by_reason_add_up_and_name_divergence_and_eviction():
    trace = load_trace(AGENT, span_days=0.01, seed=1)
    report = run_replay(
        trace, capacity_frac=0.3, tiers=parse_tiers("cpu:1,disk:2"), policies=[*POLICIES, "belady"]
    )
    for result in report.results.values():
        assert sum(result.miss_by_reason.values()) == result.miss_tokens, result.name
    assert report.results["oracle"].miss_by_reason["evicted"] == 0
    # a session whose second request edits block 1: the rest of the first is diverged
    requests = [
        Request(0.0, "s", (1, 2, 3, 4), 256),
        Request(1.0, "s", (1, 5, 6, 7, 8), 300),
        Request(2.0, "t", (9,), 64),
        Request(4000.0, "t", (9,), 64),
    ]
    hand = Trace("edit", "agent-sessions", 64, requests, 9, 2)
    got = run_replay(hand, capacity_frac=1.0, policies=["oracle", "ttl_5min", "sessioncache"])
    oracle = got.results["oracle"].miss_by_reason
    assert oracle == {"diverged": 3 * 64, "evicted": 0, "expired": 0, "new": 256 + 44 + 64}
    assert got.results["ttl_5min"].miss_by_reason["expired"] == 64


def test_a_codec_ratio_replays_the_same_disk_bytes_holding_more_blocks(
    capsys: pytest.CaptureFixture[str],
):
    argv = (str(AGENT), "--span-days", "0.5", "--capacity-frac", "0.3", "--tiers", "cpu:1,disk:2")
    out = _run_json(capsys, *argv, "--codec-ratio", "2")
    raw = {n: b for n, b in out["detail"]["capacity"]["tiers"].items()}
    coded = dict(out["codec"]["tiers"])
    assert coded["cpu"] == raw["cpu"] and coded["disk"] == 2 * raw["disk"]
    for name in POLICIES:  # more blocks held in the same bytes: never fewer hits
        assert out["codec"]["hit_rates"][name] >= out[name] - 1e-12
    args = _args(*argv, "--codec-ratio", "1.5", "--no-progress")
    assert args.func(args) == 0
    assert "at the same disk bytes" in capsys.readouterr().out
    args = _args(str(AGENT), "--tiers", "cpu:1", "--codec-ratio", "2", "--no-progress")
    assert args.func(args) == 2  # no tier a codec applies to: said, not a traceback
    assert "codec ratio applies" in capsys.readouterr().err


def test_a_session_file_gives_each_request_its_finish_and_a_subagent_its_parent(tmp_path: Path):
    doc = {
        "block_size": 64,
        "requests": [
            {"t": 0.0, "in": 128, "hash_ids": [1, 2], "stop": "tool_use", "api_time": 3.5},
            {"t": 9.0, "type": "subagent", "agent_id": "x", "requests": [
                {"t": 1.0, "in": 192, "hash_ids": [1, 2, 3], "stop": "end_turn"},
            ]},
            {"t": 20.0, "in": 192, "hash_ids": [1, 2, 4], "stop": ""},
        ],
    }  # fmt: skip
    (tmp_path / "s.json").write_text(json.dumps(doc))
    trace = load_trace(tmp_path, span_days=0)
    assert [(r.session, r.stop, r.duration, r.parent) for r in trace.requests] == [
        ("s", "tool_use", 3.5, None),
        ("s:x", "end_turn", 0.0, "s"),
        ("s", None, 0.0, None),
    ]
    assert trace.requests[0].finished == 3.5


def test_half_replays_the_even_or_odd_files(tmp_path: Path):
    even = load_trace(AGENT, half="even")  # a.json, c.json
    odd = load_trace(AGENT, half="odd")  # b.json
    assert {r.session for r in even.requests} == {"a", "a:agent_001", "c"}
    assert {r.session for r in odd.requests} == {"b"}
    with pytest.raises(InvalidInput):
        load_trace(JSONL, half="even")


class _Spy:
    """A simulator that logs what it is told, and when (by the replay's clock)."""

    name = "spy"

    def __init__(self) -> None:
        self.tier_names = ["all"]
        self.log: list[tuple[str, float, float]] = []  # (event, request time, its finish)

    def serve(self, request: Request) -> list[int]:
        self.log.append(("serve", request.time, request.finished))
        return []

    def finish(self, request: Request) -> None:
        self.log.append(("finish", request.time, request.finished))

    def detail(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def test_a_finish_is_revealed_when_the_request_ends_never_before():
    requests = [
        Request(0.0, "a", (1,), 64, "tool_use", 5.0),
        Request(2.0, "b", (2,), 64, "end_turn", 1.0),
        Request(4.0, "b", (2, 3), 128),  # b's finish (3.0) known; a's (5.0) not yet
        Request(6.0, "a", (1, 4), 128, "tool_use", 100.0),
        Request(7.0, "c", (9,), 64),
    ]
    trace = Trace("t", "agent-sessions", 64, requests, 5, 3)
    spy = _Spy()
    replay_one(trace, spy)
    served_at: list[float] = []
    for event, time, finished in spy.log:
        if event == "serve":
            served_at.append(time)
        else:  # every request served so far arrived no later than the finish
            assert all(t <= finished for t in served_at)
    finishes = [(t, f) for e, t, f in spy.log if e == "finish"]
    assert finishes == [(2.0, 3.0), (0.0, 5.0)]  # in order of their ends; 106 s never comes
    assert [e for e, _, _ in spy.log][:4] == ["serve", "serve", "finish", "serve"]


def test_the_forecast_keeps_the_tool_loop_that_lru_gives_up():
    # One tier of 5 blocks, pins off (they would keep whoever came last). Session a is in a
    # tool loop (back in seconds); b's turn ended for the user (back in minutes) after a's
    # last request. When c's 2 blocks need room, LRU takes a's tail (least recent); the
    # forecast takes b's, and a's next turn hits whole, as Belady's does.
    requests = [
        Request(0.0, "a", (1, 2, 3), 192, "tool_use", 1.0),
        Request(2.0, "b", (10, 11), 128, "end_turn", 1.0),
        Request(5.0, "c", (20, 21), 128),
        Request(8.0, "a", (1, 2, 3, 4), 256, "tool_use", 1.0),
    ]
    trace = Trace("t", "agent-sessions", 64, requests, 8, 3)
    hits = {}
    for name in ("forecast", "lru"):
        sim = StoreSim(
            name,
            [("cpu", 5 * 64)],
            block_bytes=64,
            policy=EvictionPolicy.named(name, 1),
            session_options={"pin_share": 0.0},
        )
        hits[name] = replay_one(trace, sim).hit_tokens
    belady = replay_one(trace, make_simulator("belady", trace, [("all", 5)])).hit_tokens
    assert hits["forecast"] == 192 == belady  # a's 3 blocks
    assert hits["lru"] == 64


def test_oracle_hints_give_the_node_each_sessions_true_return():
    # a's tool call takes long (back at 100 s); b's user is back in seconds (8 s): the reverse
    # of what their finish classes forecast. Told the true returns (an agent's hints), the node
    # keeps b's chain when c needs room and b's next turn hits whole; on its forecast alone
    # it keeps a's.
    requests = [
        Request(0.0, "a", (1, 2, 3), 192, "tool_use", 1.0),
        Request(2.0, "b", (10, 11, 12), 192, "end_turn", 1.0),
        Request(5.0, "c", (20, 21), 128),
        Request(8.0, "b", (10, 11, 12, 13), 256, "end_turn", 1.0),
        Request(100.0, "a", (1, 2, 3, 4), 256),
    ]
    trace = Trace("t", "agent-sessions", 64, requests, 9, 3)
    matched: dict[str, list[int]] = {}
    for hints in ("none", "oracle"):
        sim = StoreSim(
            hints,
            [("cpu", 6 * 64)],
            block_bytes=64,
            policy=EvictionPolicy.named("forecast", 1),
            session_options={"pin_share": 0.0},
            trace=trace,
            hints=hints,
        )
        matched[hints] = []
        for request in requests:
            matched[hints].append(len(sim.serve(request)))
            sim.finish(request)
    assert matched["oracle"][3:] == [3, 1]  # b's whole chain; a's head, its tail given up
    assert matched["none"][3:] == [1, 3]  # the forecast kept the tool loop's chain instead
    with pytest.raises(ValueError, match="hints"):
        StoreSim("x", [("cpu", 64)], block_bytes=64, hints="psychic")


@pytest.mark.parametrize("arrival", [1.1, 3.3, 100.3, 333.3])
def test_the_oracle_names_the_next_arrival_never_the_one_being_served(arrival: float) -> None:
    # The clock reads CLOCK_START + t; for these t, (CLOCK_START + t) - CLOCK_START falls a
    # rounding short of t, where an oracle comparing in replay seconds took the request it
    # serves for the session's next return (back in MIN_GAP_S instead of at 500 s).
    requests = [
        Request(0.0, "a", (1,), 64, "tool_use", 0.5),
        Request(arrival, "a", (1, 2), 128, "tool_use", 0.5),
        Request(500.0, "a", (1, 2, 3), 192),
    ]
    trace = Trace("t", "agent-sessions", 64, requests, 3, 1)
    sim = StoreSim("o", [("cpu", 8 * 64)], block_bytes=64, trace=trace, hints="oracle")
    sim.serve(requests[0])
    sim.finish(requests[0])
    sim.serve(requests[1])
    assert sim.sessions is not None
    state = sim.sessions.hints.snapshot((OPEN_TENANT, "a"))
    assert state is not None and state.back_at == CLOCK_START + 500.0
    sim.close()
