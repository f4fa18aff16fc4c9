"""Session-aware eviction against tail-first LRU and Belady, on held-out sessions and seeds.

    python -m bench.forecast                      # report: both halves, seeds 0-5, 6 capacities
    python -m bench.forecast --tune --halves even # pick the forecast's settings on one half

Replays a folder of agentic session files (default ``../shared/traces/agent-sessions``) through
the node's store with the forecast policy (``sessioncache`` in ``sessioncache replay``), beside
tail-first LRU and clairvoyant Belady measured in the same run, at each capacity (a share of
the sample's unique blocks, one tier), for each half of the files (even- and odd-numbered, as
``sessioncache replay --half``) and each seed of the session start times.

Each cell prints the share of the miss tokens between tail-first LRU and Belady that the
forecast saves: 1 is Belady's, 0 LRU's, below 0 worse than LRU. The targets (docs/sessions.md):
at least 0.5 at 1% and 5% capacity, and never below 0. ``--tune`` replays a small grid of
settings on the halves given and prints each one's cells; the settings are fixed by hand in
``sessioncache.store.forecast.Forecast`` from the tuning half, then reported on the other.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sessioncache.replay.runner import capacity_tiers, make_simulator, replay_one
from sessioncache.replay.simulators import StoreSim
from sessioncache.replay.trace import load_trace
from sessioncache.store.eviction import EvictionPolicy
from sessioncache.store.forecast import DEFAULT_GAPS, Forecast

DEFAULT_TRACE = Path(__file__).parents[1].parent / "shared" / "traces" / "agent-sessions"
TARGET_FRACS = (0.01, 0.05)
GAP_TARGET = 0.5


@dataclass(frozen=True)
class Cell:
    half: str
    seed: int
    frac: float
    setting: str
    lru: int
    belady: int
    ours: int

    @property
    def gain(self) -> float | None:
        """Share of the LRU -> Belady miss gap saved (None when there is no gap)."""
        if self.lru <= self.belady:
            return None
        return (self.lru - self.ours) / (self.lru - self.belady)


def grid() -> dict[str, dict[str, Any]]:
    """The settings ``--tune`` tries: the overdue rate and the in-flight gap, at the tool gap
    and dead-branch rule a first round chose (docs/benchmarks.md)."""
    out: dict[str, dict[str, Any]] = {}
    for overdue, flight in itertools.product((2.0, 3.0, 4.0, 6.0), (15.0, 25.0, 40.0, 60.0)):
        name = f"k={overdue:g} flight={flight:g}"
        out[name] = {
            "overdue": overdue,
            "gaps": {**DEFAULT_GAPS, "tool": 15.0},
            "in_flight_s": flight,
        }
    return out


def _cell(args: tuple[str, str, int, float, str, dict[str, Any] | None]) -> Cell:
    path, half, seed, frac, setting, forecast = args
    trace = load_trace(path, seed=seed, half=None if half == "all" else half)
    split = capacity_tiers(trace, frac)
    bt = trace.block_tokens
    lru = replay_one(trace, make_simulator("lru_tail_first", trace, split)).miss_tokens
    belady = replay_one(trace, make_simulator("belady", trace, split)).miss_tokens
    policy = EvictionPolicy(len(split), Forecast(**forecast) if forecast else Forecast())
    sim = StoreSim(
        "sessioncache", [(t, blocks * bt) for t, blocks in split], block_bytes=bt, policy=policy
    )
    ours = replay_one(trace, sim).miss_tokens
    return Cell(half, seed, frac, setting, lru, belady, ours)


def _table(cells: Sequence[Cell], fracs: Sequence[float]) -> list[str]:
    lines = [f"  {'seed':>6}" + "".join(f"{f:>8.1%}" for f in fracs)]
    seeds = sorted({c.seed for c in cells})
    by = {(c.seed, c.frac): c for c in cells}
    for seed in seeds:
        row = f"  {seed:>6}"
        for f in fracs:
            gain = by[(seed, f)].gain if (seed, f) in by else None
            row += f"{gain:>8.2f}" if gain is not None else f"{'=':>8}"
        lines.append(row)
    means = []
    for f in fracs:
        gains = [g for s in seeds if (g := by[(s, f)].gain) is not None]
        means.append(f"{sum(gains) / len(gains):>8.2f}" if gains else f"{'=':>8}")
    lines.append(f"  {'mean':>6}" + "".join(means))
    return lines


def verdict(cells: Sequence[Cell]) -> tuple[int, int, int, int]:
    """(cells at a target capacity, of them meeting 0.5, cells, of them no worse than LRU)."""
    at = [c for c in cells if c.frac in TARGET_FRACS and c.gain is not None]
    met = sum(1 for c in at if c.gain is not None and c.gain >= GAP_TARGET)
    never_worse = sum(1 for c in cells if c.ours <= c.lru)
    return len(at), met, len(cells), never_worse


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="a folder of session files")
    parser.add_argument("--fracs", default="0.005,0.01,0.02,0.05,0.1,0.2")
    parser.add_argument("--seeds", default="0,1,2,3,4,5")
    parser.add_argument("--halves", default="even,odd", help="even, odd, all (every file)")
    parser.add_argument("--tune", action="store_true", help="replay the settings grid")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", action="store_true", help="also print the cells as JSON")
    args = parser.parse_args(argv)
    fracs = [float(x) for x in args.fracs.split(",") if x]
    seeds = [int(x) for x in args.seeds.split(",") if x]
    halves = [x for x in args.halves.split(",") if x]
    settings: dict[str, dict[str, Any] | None] = {"default": None}
    if args.tune:
        settings = dict(grid())
    jobs = [
        (args.trace, half, seed, frac, name, forecast)
        for name, forecast in settings.items()
        for half in halves
        for seed in seeds
        for frac in fracs
    ]
    print(
        f"{args.trace}: {len(halves)} half(s) x {len(seeds)} seed(s) x {len(fracs)} "
        f"capacities x {len(settings)} setting(s), {args.jobs} job(s)",
        file=sys.stderr,
    )
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        cells = list(pool.map(_cell, jobs))
    print("share of the miss tokens between lru_tail_first and belady saved by the forecast")
    print("(1 = belady, 0 = lru_tail_first, < 0 worse than lru_tail_first, '=' no gap)")
    summary = []
    for name in settings:
        for half in halves:
            mine = [c for c in cells if c.setting == name and c.half == half]
            at, met, n, ok = verdict(mine)
            print(f"\n{name}, {half} half" if half != "all" else f"\n{name}, every file")
            print("\n".join(_table(mine, fracs)))
            print(
                f"  targets: >= {GAP_TARGET} at {', '.join(f'{f:.0%}' for f in TARGET_FRACS)}: "
                f"{met} of {at} cells; no worse than lru_tail_first: {ok} of {n} cells"
            )
            summary.append((name, half, met, at, ok, n))
    if args.tune:
        print("\nsettings by cells meeting the targets, then no worse than LRU:")
        ranked = sorted(summary, key=lambda s: (-s[2], -s[4]))
        for name, half, met, at, ok, n in ranked:
            print(f"  {met:>3}/{at:<3} {ok:>3}/{n:<3} {half:>5}  {name}")
    if args.json:
        print(json.dumps([{**c.__dict__, "gain": c.gain} for c in cells]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
