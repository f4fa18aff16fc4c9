"""Session-aware eviction, fitted and chosen by cross-validation, against tail-first LRU and
Belady on sessions it never saw.

    python -m bench.forecast --fit [--hist]        # the class priors, fitted on every session
    python -m bench.forecast --cv                  # 5 folds: fit, choose, report held out
    python -m bench.forecast --check               # the node's defaults on the 30 shared sessions
    python -m bench.forecast --cv --tiers cpu:1,disk:16 --settings default

``--cv`` splits the sessions of ``--trace`` (default ``../shared/traces/agent-sessions-more``,
301 sessions) into 5 folds by session (a seeded shuffle of the file names). For each fold it
fits the class priors (``forecast.fit_gap``) on the other four, replays the held-out fold
through the node's store (``replay.simulators.StoreSim``, the ``sessioncache`` policy) under
each setting of the grid (``--settings``), beside tail-first LRU and Belady at the same
capacity (a share of that fold's unique blocks), for each seed of the session start times
(3 days). A setting's score is its mean held-out gap saved over the folds, seeds and the
target capacities; the best is chosen by that mean alone, then printed fold by fold.
``--check`` replays the node's defaults (priors fitted on all of ``--trace``) on
``--check-trace`` (default ``../shared/traces/agent-sessions``, 30 sessions none of the folds
hold).

"Gap saved" is the share of the miss tokens between tail-first LRU and Belady that the policy
saves: 1 is Belady's, 0 LRU's, below 0 worse than LRU. With more than one tier each cell also
prints the first tier's hit tokens (policy against LRU) and a TTFT proxy: missed tokens count
1, tokens loaded from a lower tier ``--load-cost`` (0.1: a disk read of a block costs about a
tenth of recomputing it), first-tier hits 0.

``--settings "default hints=oracle"`` replays the default with every session telling the node
exactly when it is next back (``StoreSim``'s ``hints="oracle"``): not a setting, the reference
of what exact return dates are worth to the node's eviction, printed apart from the choice.
``"default pins=forecast"`` is the default with a session's pins released at a finish whose
forecast return lies past the idle timeout (``SessionManager``'s ``pins_follow_forecast``): a
setting a node can run, chosen among the others.

Baselines (LRU, Belady) do not depend on the setting: ``--cache FILE`` keeps them between
runs. One process, one replay at a time (``--jobs`` for more).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sessioncache.replay.runner import (
    PolicyResult,
    capacity_tiers,
    make_simulator,
    parse_tiers,
    replay_one,
)
from sessioncache.replay.simulators import StoreSim
from sessioncache.replay.trace import Request, Trace, load_trace
from sessioncache.store.eviction import EvictionPolicy
from sessioncache.store.forecast import (
    CLASSES,
    FINISH_CLASSES,
    FLIGHT,
    MIN_GAP_S,
    POOLED,
    Distribution,
    Forecast,
    Gap,
    Hist,
    fit_gap,
    fit_hist,
)

SHARED = Path(__file__).parents[1].parent / "shared" / "traces"
DEFAULT_TRACE = SHARED / "agent-sessions-more"
CHECK_TRACE = SHARED / "agent-sessions"
TARGET_FRACS = (0.01, 0.05)
GAP_TARGETS = {0.01: 0.5, 0.05: 0.3}
WORSE_LIMIT = 0.002
"""No fold may miss more than this share of LRU's miss tokens beyond LRU's."""
FOLDS = 5
FOLD_SEED = 46

Priors = dict[str, dict[str, Distribution]]
"""``{"top": class -> Gap, "sub": class -> Gap}``."""


# -- fitting ----------------------------------------------------------------------------------


def gaps_of(requests: Iterable[Request]) -> dict[tuple[bool, str], tuple[list[float], int]]:
    """Per (subagent?, class): the gaps from each event of that class to the session's next
    arrival, and how many events there were (the last ones never followed). Events as the node
    sees them: an arrival (``flight``, to the next arrival) and a finish with its reason."""
    last: dict[str, Request] = {}
    out: dict[tuple[bool, str], tuple[list[float], int]] = {}

    def note(sub: bool, cls: str, gap: float | None) -> None:
        gaps, n = out.get((sub, cls), ([], 0))
        if gap is not None:
            gaps.append(max(MIN_GAP_S, gap))
        out[(sub, cls)] = (gaps, n + 1)

    ordered = sorted(requests, key=lambda r: r.time)
    for r in ordered:
        if r.session is None:
            continue
        prev = last.get(r.session)
        if prev is not None:
            sub = prev.parent is not None
            note(sub, FLIGHT, r.time - prev.time)
            cls = FINISH_CLASSES.get(prev.stop) if prev.stop else None
            if cls is not None:
                note(sub, cls, r.time - prev.finished)
        last[r.session] = r
    for prev in last.values():  # never followed
        sub = prev.parent is not None
        note(sub, FLIGHT, None)
        cls = FINISH_CLASSES.get(prev.stop) if prev.stop else None
        if cls is not None:
            note(sub, cls, None)
    return out


def fit_priors(requests: Iterable[Request], *, hist: bool = False) -> Priors:
    """The class priors of top-level sessions and of subagents. A class seen but never
    followed keeps a small ``p`` with its kind's pooled log-normal; a class never seen takes
    its kind's pooled gap; a kind never seen takes the other's. With ``hist``, a class (and
    the pooled gap) seen followed ``HIST_MIN_GAPS`` times or more is a histogram instead
    (``fit_hist``)."""
    seen = gaps_of(list(requests))
    out: Priors = {}
    hists: dict[tuple[bool, str], Distribution] = {}
    for sub, kind in ((False, "top"), (True, "sub")):
        pooled_gaps: list[float] = []
        pooled_n = 0
        for cls in CLASSES:
            gaps, n = seen.get((sub, cls), ([], 0))
            if cls != FLIGHT:
                pooled_gaps += gaps
                pooled_n += n
        fitted: dict[str, Gap] = {}
        if pooled_gaps:
            fitted[POOLED] = fit_gap(pooled_gaps, pooled_n)
        for cls in CLASSES:
            gaps, n = seen.get((sub, cls), ([], 0))
            if gaps or (n and POOLED in fitted):
                fitted[cls] = fit_gap(gaps, n, like=fitted.get(POOLED))
        if POOLED not in fitted and FLIGHT in fitted:
            fitted[POOLED] = fitted[FLIGHT]
        if hist:  # a histogram where a class was seen followed often enough to draw one
            if len(pooled_gaps) >= HIST_MIN_GAPS:
                hists[(sub, POOLED)] = fit_hist(pooled_gaps, pooled_n)
            for cls in CLASSES:
                gaps, n = seen.get((sub, cls), ([], 0))
                if len(gaps) >= HIST_MIN_GAPS:
                    hists[(sub, cls)] = fit_hist(gaps, n)
        out[kind] = dict(fitted)
    for kind, other in (("top", "sub"), ("sub", "top")):
        for cls in (*CLASSES, POOLED):
            if cls not in out[kind]:
                out[kind][cls] = out[kind].get(POOLED) or out[other][cls]
    for (sub, cls), fitted_hist in hists.items():
        out["sub" if sub else "top"][cls] = fitted_hist
    for sub, kind in ((False, "top"), (True, "sub")):
        for cls in CLASSES:  # never seen: the kind's pooled gap, a histogram where it is one
            if (sub, cls) not in seen and (sub, POOLED) in hists:
                out[kind][cls] = hists[(sub, POOLED)]
    return out


HIST_MIN_GAPS = 20
"""A class's histogram needs this many gaps seen; with fewer it keeps its log-normal."""


PriorsJson = dict[str, dict[str, list[float]]]
"""Per kind and class: ``[p, mu, sigma]`` of a log-normal, or a histogram's survivals
prefixed by ``-1``."""


def priors_json(priors: Priors) -> PriorsJson:
    def one(g: Distribution) -> list[float]:
        if isinstance(g, Hist):
            return [-1.0, *(round(x, 6) for x in g.surv)]
        return [round(g.p, 4), round(g.mu, 4), round(g.sigma, 4)]

    return {kind: {cls: one(g) for cls, g in gaps.items()} for kind, gaps in priors.items()}


def priors_from_json(doc: Mapping[str, Mapping[str, Sequence[float]]]) -> Priors:
    def one(v: Sequence[float]) -> Distribution:
        return Hist(tuple(v[1:])) if v[0] == -1 else Gap(*v)

    return {kind: {cls: one(v) for cls, v in gaps.items()} for kind, gaps in doc.items()}


# -- settings ---------------------------------------------------------------------------------


def grid() -> dict[str, dict[str, Any]]:
    """The settings ``--cv`` chooses among (``Forecast`` fields; priors come from the fold):
    Belady's rule on the distribution's quantile with a receding term (``next_use``), by the
    quantile and how much a session's own gaps count (``shrink``: pseudo-observations of the
    prior; inf: the class priors alone) and by the cap on a predicted return (``beyond``
    horizons ahead), and the expected value within the measured horizon (``value``)."""
    out: dict[str, dict[str, Any]] = {}
    for quantile, shrink in (
        (0.6, math.inf),
        (0.7, math.inf),
        (0.8, math.inf),
        (0.9, math.inf),
        (0.7, 16.0),
        (0.7, 4.0),
    ):
        name = f"next_use q={quantile:g}" + (f" shrink={shrink:g}" if shrink < math.inf else "")
        out[name] = {
            "mode": "next_use",
            "quantile": quantile,
            "shrink": shrink,
            "overdue": 4.0,
            "dead_branch_s": 3600.0,
            "beyond": math.inf,
        }
    for beyond in (1.0, 2.0, 4.0):
        out[f"next_use q=0.8 beyond={beyond:g}"] = {
            "mode": "next_use",
            "quantile": 0.8,
            "shrink": math.inf,
            "overdue": 4.0,
            "dead_branch_s": 3600.0,
            "beyond": beyond,
        }
    out["value"] = {"mode": "value", "adapt": False}
    out[CHANCE] = {"mode": "chance", "dead_branch_s": None, "hist": True}
    out[CHANCE + " pins=0"] = {**out[CHANCE], "pin_share": 0.0}
    out["default pins=0"] = {**setting("default"), "pin_share": 0.0}
    out[STOPPING] = setting("default")
    return out


DEFAULT: dict[str, Any] = {"mode": "chance", "dead_branch_s": None, "hist": True, "stopping": True}
"""The node's default (``forecast.node_forecast``), its priors fitted on the training folds."""
CHANCE = "chance hist"
"""Hit density (``Forecast.mode`` ``chance``) over histograms of the gaps (``fit_hist``), a
branch left behind dead, over the tier's whole horizon (the default before ``stopping``)."""


STOPPING = "chance stopping"
"""The default by the name it was cross-validated under: hit density at its best stopping
point (``Forecast.stopping``)."""


ORACLE_HINTS = "default hints=oracle"
"""Not a setting a node can run: the default, with every session telling the node exactly when
it is next back (``StoreSim``'s ``hints="oracle"``): what exact return dates are worth, the
reference a forecast is measured against beside Belady."""


PREFETCH = "default prefetch"
"""The default as a node runs it, its forecast prefetch on (``SESSIONCACHE_PREFETCH_FORECAST``,
``StoreSim``'s ``prefetch="forecast"``): chains moved up into the first tier ahead of their
sessions' forecast return. It changes which tier serves a hit more than whether one is."""


PINS_FORECAST = "default pins=forecast"
"""The default with a session's pins released at a finish forecast back past the idle timeout
(``SESSIONCACHE_PINS_FOLLOW_FORECAST=true``): a setting a node can run, chosen among the
others (off by default for tenant isolation: docs/sessions.md)."""

SESSION_OPTIONS = ("pins_follow_forecast", "pin_share")
"""The options of a setting that are the sessions', not the forecast's."""


def setting(name: str) -> dict[str, Any]:
    if name == "default":
        return dict(DEFAULT)
    if name == ORACLE_HINTS:
        return {**DEFAULT, "hints": "oracle"}
    if name == PREFETCH:
        return {**DEFAULT, "prefetch": "forecast"}
    if name == PINS_FORECAST:
        return {**DEFAULT, "pins_follow_forecast": True}
    options = grid()
    if name not in options:
        raise SystemExit(
            f"unknown setting {name!r}; settings are default, {ORACLE_HINTS!r}, {PREFETCH!r}, "
            f"{PINS_FORECAST!r}, {sorted(options)}"
        )
    return options[name]


def make_forecast(options: Mapping[str, Any], priors: Priors | None) -> Forecast:
    options = {
        k: v
        for k, v in options.items()
        if k not in ("hints", "hist", "prefetch") and k not in SESSION_OPTIONS
    }
    if priors is None:
        return Forecast(**options)
    return Forecast(priors=priors["top"], subagent_priors=priors["sub"], **options)


# -- cells ------------------------------------------------------------------------------------


@dataclass
class Cell:
    fold: str
    seed: int
    frac: float
    setting: str
    lru: int
    belady: int
    ours: int
    total: int = 0
    lru_first: int = 0
    """Hit tokens in the first tier (more than one tier)."""
    ours_first: int = 0
    lru_ttft: float = 0.0
    ours_ttft: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def gain(self) -> float | None:
        """Share of the LRU -> Belady miss gap saved (None when there is no gap)."""
        if self.lru <= self.belady:
            return None
        return (self.lru - self.ours) / (self.lru - self.belady)

    @property
    def worse(self) -> float:
        """Miss tokens beyond LRU's, as a share of LRU's (0 when no worse)."""
        return max(0, self.ours - self.lru) / self.lru if self.lru else 0.0


def ttft_proxy(result: PolicyResult, load_cost: float) -> float:
    """Missed tokens plus ``load_cost`` per token loaded from below the first tier."""
    first = next(iter(result.tier_hit_tokens.values()), 0)
    return result.miss_tokens + load_cost * (result.hit_tokens - first)


def load_fold(path: str, only: Sequence[str] | None, seed: int) -> Trace:
    return load_trace(path, seed=seed, only=only)


def baselines(
    trace: Trace, frac: float, tiers: Sequence[tuple[str, float]], load_cost: float
) -> dict[str, Any]:
    split = capacity_tiers(trace, frac, tiers)
    lru = replay_one(trace, make_simulator("lru_tail_first", trace, split))
    belady = replay_one(trace, make_simulator("belady", trace, split))
    return {
        "lru": lru.miss_tokens,
        "belady": belady.miss_tokens,
        "total": lru.total_tokens,
        "lru_first": next(iter(lru.tier_hit_tokens.values()), 0),
        "lru_ttft": ttft_proxy(lru, load_cost),
    }


def ours(
    trace: Trace,
    frac: float,
    tiers: Sequence[tuple[str, float]],
    forecast: Forecast,
    load_cost: float,
    hints: str = "none",
    sessions: Mapping[str, Any] | None = None,
    prefetch: str | None = None,
) -> PolicyResult:
    """The node's store and sessions (``sessions``: the manager's options) over ``trace``."""
    split = capacity_tiers(trace, frac, tiers)
    bt = trace.block_tokens
    policy = EvictionPolicy(len(split), forecast)
    sim = StoreSim(
        "sessioncache",
        [(t, blocks * bt) for t, blocks in split],
        block_bytes=bt,
        policy=policy,
        trace=trace,
        hints=hints,
        session_options=sessions,
        prefetch=prefetch,
    )
    return replay_one(trace, sim)


@dataclass
class Job:
    path: str
    fold: str
    only: list[str] | None
    seed: int
    frac: float
    tiers: list[tuple[str, float]]
    settings: dict[str, dict[str, Any]]
    priors: PriorsJson | None
    hist_priors: PriorsJson | None
    base: dict[str, Any] | None
    load_cost: float


def run_job(job: Job) -> tuple[dict[str, Any], list[Cell]]:
    """Replay one fold at one seed and capacity: the baselines (unless given) and each
    setting."""
    trace = load_fold(job.path, job.only, job.seed)
    base = job.base or baselines(trace, job.frac, job.tiers, job.load_cost)
    cells: list[Cell] = []
    for name, options in job.settings.items():
        doc = job.hist_priors if options.get("hist") else job.priors
        forecast = make_forecast(options, priors_from_json(doc) if doc is not None else None)
        result = ours(
            trace,
            job.frac,
            job.tiers,
            forecast,
            job.load_cost,
            options.get("hints", "none"),
            {k: v for k, v in options.items() if k in SESSION_OPTIONS},
            options.get("prefetch"),
        )
        cells.append(
            Cell(
                job.fold,
                job.seed,
                job.frac,
                name,
                base["lru"],
                base["belady"],
                result.miss_tokens,
                base["total"],
                base["lru_first"],
                next(iter(result.tier_hit_tokens.values()), 0),
                base["lru_ttft"],
                ttft_proxy(result, job.load_cost),
                {"seconds": round(result.seconds, 1)},
            )
        )
    return base, cells


def folds_of(path: str, k: int = FOLDS, seed: int = FOLD_SEED) -> list[list[str]]:
    """The files of ``path`` (stems) in ``k`` folds: a seeded shuffle, dealt round."""
    stems = sorted(p.stem for p in Path(path).glob("*.json"))
    random.Random(seed).shuffle(stems)
    return [sorted(stems[i::k]) for i in range(k)]


# -- reports ----------------------------------------------------------------------------------


def _fmt(x: float | None) -> str:
    return f"{x:>8.2f}" if x is not None else f"{'=':>8}"


def mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def score(cells: Sequence[Cell]) -> float:
    """A setting's score: its mean gap saved over the target capacities' cells (each
    capacity weighted alike)."""
    per_frac = []
    for f in TARGET_FRACS:
        gains = [c.gain for c in cells if c.frac == f and c.gain is not None]
        if gains:
            per_frac.append(sum(gains) / len(gains))
    return sum(per_frac) / len(per_frac) if per_frac else -math.inf


def table(cells: Sequence[Cell], fracs: Sequence[float], tiers: int) -> list[str]:
    """Per fold (mean over seeds): gap saved at each capacity, worst excess over LRU."""
    lines = [
        f"  {'fold':>6}"
        + "".join(f"{f:>8.1%}" for f in fracs)
        + f"{'worst':>9}"
        + (f"{'1st tier hits ours/lru':>26}" if tiers > 1 else "")
    ]
    folds = sorted({c.fold for c in cells}, key=lambda x: (len(x), x))
    for fold in [*folds, "mean"]:
        mine = cells if fold == "mean" else [c for c in cells if c.fold == fold]
        row = f"  {fold:>6}"
        for f in fracs:
            gains = [c.gain for c in mine if c.frac == f and c.gain is not None]
            row += _fmt(mean(gains))
        worst = max((c.worse for c in mine), default=0.0)
        row += f"{worst:>9.3%}"
        if tiers > 1:
            hits = [c.ours_first / c.lru_first for c in mine if c.lru_first]
            low = min(hits, default=math.nan)
            row += f"{'min ' + format(low, '.3f'):>26}"
        lines.append(row)
    return lines


def rates(cells: Sequence[Cell], fracs: Sequence[float], tiers: int) -> list[str]:
    """Token hit rates (LRU / policy / Belady), summed over the cells of each capacity."""
    lines = []
    for f in fracs:
        mine = [c for c in cells if c.frac == f]
        total = sum(c.total for c in mine)
        if not total:
            continue
        lru = 1 - sum(c.lru for c in mine) / total
        ours_ = 1 - sum(c.ours for c in mine) / total
        bel = 1 - sum(c.belady for c in mine) / total
        line = f"  {f:>6.1%}: lru_tail_first {lru:.2%}  sessioncache {ours_:.2%}  belady {bel:.2%}"
        if tiers > 1:
            first_l = sum(c.lru_first for c in mine) / total
            first_o = sum(c.ours_first for c in mine) / total
            ttft = sum(c.ours_ttft for c in mine) / max(1.0, sum(c.lru_ttft for c in mine))
            line += (
                f"  first tier: lru {first_l:.2%} sessioncache {first_o:.2%}"
                f"  TTFT proxy sessioncache/lru {ttft:.3f}"
            )
        lines.append(line)
    return lines


def verdict(cells: Sequence[Cell], tiers: int) -> list[str]:
    out = []
    for f in TARGET_FRACS:
        gains = [c.gain for c in cells if c.frac == f and c.gain is not None]
        m = mean(gains)
        if m is None:
            continue
        target = GAP_TARGETS[f]
        met = "met" if m >= target else "MISSED"
        out.append(f"  mean gap saved at {f:.0%}: {m:.3f} (>= {target}: {met})")
    # Each fold at each capacity on its own: a fold's savings at one capacity must not hide
    # what it loses at another.
    worst = []
    for fold, frac in sorted({(c.fold, c.frac) for c in cells}):
        mine = [c for c in cells if c.fold == fold and c.frac == frac]
        lru = sum(c.lru for c in mine)
        extra = sum(c.ours for c in mine) - lru
        worst.append(max(0.0, extra / lru) if lru else 0.0)
    bad_cells = max((c.worse for c in cells), default=0.0)
    if worst:
        ok = max(worst) <= WORSE_LIMIT
        out.append(
            f"  worst fold beyond lru_tail_first: {max(worst):.3%} of its miss tokens "
            f"(<= {WORSE_LIMIT:.1%}: {'met' if ok else 'MISSED'}); "
            f"worst single cell {bad_cells:.3%}"
        )
    if tiers > 1:
        short = [c for c in cells if c.ours_first < c.lru_first]
        out.append(
            f"  first-tier hits >= lru_tail_first's: {len(cells) - len(short)} of {len(cells)} "
            f"cells ({'met' if not short else 'MISSED'})"
        )
    return out


# -- main -------------------------------------------------------------------------------------


class BaseCache:
    """LRU and Belady per (trace, fold, seed, capacity, tiers), kept in a JSON file."""

    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None
        self.data: dict[str, Any] = {}
        if self.path is not None and self.path.exists():
            self.data = json.loads(self.path.read_text())

    @staticmethod
    def key(job: Job) -> str:
        tiers = ",".join(f"{n}:{w:g}" for n, w in job.tiers)
        return f"{Path(job.path).name}|{job.fold}|{job.seed}|{job.frac:g}|{tiers}|{job.load_cost:g}"

    def get(self, job: Job) -> dict[str, Any] | None:
        found: dict[str, Any] | None = self.data.get(self.key(job))
        return found

    def put(self, job: Job, base: dict[str, Any]) -> None:
        self.data[self.key(job)] = base
        if self.path is not None:
            self.path.write_text(json.dumps(self.data, indent=0, sort_keys=True))


def run(jobs: list[Job], cache: BaseCache, workers: int) -> list[Cell]:
    """Each job (``workers`` at a time), each printed as it ends, in order."""
    for job in jobs:
        job.base = cache.get(job)
    cells: list[Cell] = []
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=workers) if workers > 1 else _Serial() as pool:
        for i, (job, (base, done)) in enumerate(zip(jobs, pool.map(run_job, jobs), strict=True)):
            cache.put(job, base)
            cells += done
            print(
                f"  [{i + 1}/{len(jobs)} {time.perf_counter() - started:.0f}s] fold {job.fold} "
                f"seed {job.seed} {job.frac:.1%}: "
                + ", ".join(f"{c.setting}: {_fmt(c.gain).strip()}" for c in done),
                file=sys.stderr,
                flush=True,
            )
    return cells


class _Serial:
    """``ProcessPoolExecutor``'s ``map`` in this process, one job at a time."""

    def __enter__(self) -> _Serial:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def map(self, fn: Callable[[Job], Any], jobs: Iterable[Job]) -> Iterator[Any]:
        return map(fn, jobs)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="sessions to fit and fold")
    parser.add_argument("--check-trace", default=str(CHECK_TRACE), help="held-out sessions")
    parser.add_argument("--fracs", default="0.01,0.05")
    parser.add_argument("--seeds", default="0,1,2,3,4,5")
    parser.add_argument("--k", type=int, default=FOLDS, help="how many folds")
    parser.add_argument("--folds", default="", help="fold numbers to replay (all by default)")
    parser.add_argument("--tiers", default="cpu:1")
    parser.add_argument("--settings", default="", help="names from the grid, or default")
    parser.add_argument("--fit", action="store_true", help="print the priors fitted on --trace")
    parser.add_argument(
        "--hist",
        action="store_true",
        help="with --fit: histograms where a class was seen followed often enough (fit_hist)",
    )
    parser.add_argument("--cv", action="store_true", help="cross-validate over --trace")
    parser.add_argument("--check", action="store_true", help="replay --check-trace")
    parser.add_argument("--load-cost", type=float, default=0.1)
    parser.add_argument("--cache", default=None, help="a JSON file of baselines kept across runs")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="also print the cells as JSON")
    args = parser.parse_args(argv)
    fracs = [float(x) for x in args.fracs.split(",") if x]
    seeds = [int(x) for x in args.seeds.split(",") if x]
    tiers = parse_tiers(args.tiers)
    names = [x for x in args.settings.split(",") if x] or (list(grid()) if args.cv else ["default"])
    settings = {name: setting(name) for name in names}
    cache = BaseCache(args.cache)
    all_cells: list[Cell] = []
    if args.fit:
        priors = fit_priors(load_trace(args.trace).requests, hist=args.hist)
        print(json.dumps(priors_json(priors), indent=1))
    if args.cv:
        folds = folds_of(args.trace, args.k)
        pick = [int(x) for x in args.folds.split(",") if x] or list(range(len(folds)))
        fitted: dict[int, Priors] = {}
        hists: dict[int, Priors] = {}
        for k in pick:
            train = [s for i, f in enumerate(folds) if i != k for s in f]
            requests = load_trace(args.trace, only=train).requests
            fitted[k] = fit_priors(requests)
            hists[k] = fit_priors(requests, hist=True)
        jobs = [
            Job(
                args.trace,
                str(k),
                folds[k],
                seed,
                frac,
                tiers,
                settings,
                priors_json(fitted[k]),
                priors_json(hists[k]),
                None,
                args.load_cost,
            )
            for seed in seeds
            for frac in fracs
            for k in pick
        ]
        print(
            f"{args.trace}: {len(pick)} of {len(folds)} folds x {len(seeds)} seed(s) x "
            f"{len(fracs)} capacities x {len(settings)} setting(s), tiers {args.tiers}",
            file=sys.stderr,
        )
        cells = run(jobs, cache, args.jobs)
        all_cells += cells
        choices = [n for n in settings if n != ORACLE_HINTS] or list(settings)
        ranked = sorted(choices, key=lambda n: -score([c for c in cells if c.setting == n]))
        print("held-out gap saved (share of the miss tokens between lru_tail_first and belady)")
        print("by setting, mean over folds, seeds and the target capacities:")
        for name in ranked:
            print(f"  {score([c for c in cells if c.setting == name]):>7.3f}  {name}")
        if ORACLE_HINTS in settings and ORACLE_HINTS not in ranked:
            oracle = score([c for c in cells if c.setting == ORACLE_HINTS])
            print(f"  {oracle:>7.3f}  {ORACLE_HINTS} (a reference: exact return dates)")
            print("\n".join(table([c for c in cells if c.setting == ORACLE_HINTS], fracs, 1)))
        best = ranked[0]
        print(f"\nchosen: {best}; per held-out fold (mean over seeds {args.seeds}):")
        mine = [c for c in cells if c.setting == best]
        print("\n".join(table(mine, fracs, len(tiers))))
        print("\n".join(rates(mine, fracs, len(tiers))))
        print("\n".join(verdict(mine, len(tiers))))
    if args.check:
        wants_hist = any(options.get("hist") for options in settings.values())
        check_hists = (
            priors_json(fit_priors(load_trace(args.trace).requests, hist=True))
            if wants_hist
            else None
        )
        jobs = [
            Job(
                args.check_trace,
                "check",
                None,
                seed,
                frac,
                tiers,
                settings,
                None,
                check_hists,
                None,
                args.load_cost,
            )
            for seed in seeds
            for frac in fracs
        ]
        cells = run(jobs, cache, args.jobs)
        all_cells += cells
        for name in settings:
            mine = [c for c in cells if c.setting == name]
            print(f"\n{args.check_trace} ({name}; default priors): gap saved per seed")
            by = {(c.seed, c.frac): c for c in mine}
            print(f"  {'seed':>6}" + "".join(f"{f:>8.1%}" for f in fracs))
            for seed in seeds:
                print(
                    f"  {seed:>6}"
                    + "".join(_fmt(by[(seed, f)].gain if (seed, f) in by else None) for f in fracs)
                )
            print("\n".join(rates(mine, fracs, len(tiers))))
            print("\n".join(verdict(mine, len(tiers))))
    if args.json:
        print(json.dumps([{**asdict(c), "gain": c.gain} for c in all_cells]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
