"""Run a trace through every policy at one capacity and score the token hit rates.

Capacity: ``capacity_frac x unique blocks`` blocks in total, one byte per token of a block
(only ratios matter), split over the tiers by weight, the same split for every policy. The
default is one tier, which scores the eviction policy alone; ``cpu:1,disk:16`` is the
service's default configuration (4 GiB of CPU over 64 GiB of disk) and also exercises
demotion and promotion. The oracle ignores capacity.

Token hit rate = hit tokens / input tokens, where a request whose first ``m`` blocks hit saves
``min(m x block_tokens, input tokens)`` tokens; per tier, each hit block's tokens are credited
to the fastest tier that held it at lookup.

Prefetch (``prefetch=``, ``PREFETCH_MODES``): the node's default policy replayed again with
its prefetch engine moving chains up ahead of their reads (``forecast``: the node's forecast
pass; ``oracle``: the same engine knowing each session's next arrival; ``none``: no prefetch,
the ``sessioncache`` policy's run when there is one). Each is scored by its hit rate and its
``cpu_share``: hit tokens served from the first tier over all hit tokens.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sessioncache.errors import InvalidInput
from sessioncache.replay.simulators import (
    PREFETCH_MODES,
    BeladySim,
    LruSim,
    OracleSim,
    Simulator,
    StoreSim,
)
from sessioncache.replay.trace import Request, Trace
from sessioncache.store.eviction import EvictionPolicy

POLICIES = ("oracle", "lru", "ttl_5min", "sessioncache")
"""The four policies every replay reports, in report order. ``sessioncache`` is the node's
default (``forecast``)."""
EXTRA_POLICIES = ("lru_tail_first", "belady", "sessioncache_lru")
"""Further baselines that ``policies=`` may ask for: ``sessioncache_lru`` is the node with
``SESSIONCACHE_EVICTION_POLICY=lru``."""
DEFAULT_TIERS: tuple[tuple[str, float], ...] = (("cpu", 1.0),)
TTL_5MIN_S = 300.0

Progress = Callable[[int], None]
"""Called with the number of requests just served."""


@dataclass(frozen=True, slots=True)
class PolicyResult:
    name: str
    hit_tokens: int
    total_tokens: int
    tier_hit_tokens: dict[str, int]
    hit_blocks: int
    requests: int
    seconds: float
    detail: dict[str, Any] = field(default_factory=dict)
    miss_by_reason: dict[str, int] = field(default_factory=dict)
    """Missed tokens by reason (``attribute_misses``): diverged, evicted, expired, new."""

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def miss_tokens(self) -> int:
        return self.total_tokens - self.hit_tokens

    @property
    def first_tier_share(self) -> float:
        """Hit tokens served from the first tier over all hit tokens."""
        first = next(iter(self.tier_hit_tokens.values()), 0)
        return first / self.hit_tokens if self.hit_tokens else 0.0

    def tier_hit_rates(self) -> dict[str, float]:
        total = self.total_tokens or 1
        return {name: tokens / total for name, tokens in self.tier_hit_tokens.items()}


@dataclass(frozen=True, slots=True)
class ReplayReport:
    trace: Trace
    capacity_frac: float
    tiers: list[tuple[str, int]]
    """Capacity of each tier, in blocks."""
    results: dict[str, PolicyResult]
    prefetch: dict[str, PolicyResult] = field(default_factory=dict)
    """The node's default policy under each prefetch mode asked for (``PREFETCH_MODES``)."""

    @property
    def capacity_blocks(self) -> int:
        return sum(blocks for _, blocks in self.tiers)

    def hit_rates(self) -> dict[str, float]:
        return {name: r.hit_rate for name, r in self.results.items()}

    def to_json(self) -> dict[str, Any]:
        """``{"oracle": rate, "lru": .., "ttl_5min": .., "sessioncache": .., "detail": {...}}``"""
        out: dict[str, Any] = {name: r.hit_rate for name, r in self.results.items()}
        trace = self.trace
        oracle = self.results.get("oracle")
        policies: dict[str, Any] = {}
        for name, r in self.results.items():
            policies[name] = {
                "hit_rate": r.hit_rate,
                "hit_tokens": r.hit_tokens,
                "miss_tokens": r.miss_tokens,
                "misses_vs_oracle": (
                    r.miss_tokens / oracle.miss_tokens if oracle and oracle.miss_tokens else None
                ),
                "tier_hit_rates": r.tier_hit_rates(),
                "hit_blocks": r.hit_blocks,
                "miss_by_reason": r.miss_by_reason,
                "seconds": round(r.seconds, 3),
                **r.detail,
            }
        out["detail"] = {
            "trace": {
                "name": trace.name,
                "kind": trace.kind,
                "block_tokens": trace.block_tokens,
                "requests": len(trace.requests),
                "sessions": trace.sessions,
                "input_tokens": trace.total_tokens,
                "blocks": trace.total_blocks,
                "unique_blocks": trace.unique_blocks,
                "span_s": trace.requests[-1].time - trace.requests[0].time
                if trace.requests
                else 0.0,
            },
            "capacity": {
                "frac": self.capacity_frac,
                "blocks": self.capacity_blocks,
                "tiers": {name: blocks for name, blocks in self.tiers},
            },
            "policies": policies,
        }
        if self.prefetch:
            out["prefetch"] = {
                mode: {
                    "cpu_share": r.first_tier_share,
                    "hit": r.hit_rate,
                    "hit_tokens": r.hit_tokens,
                    "tier_hit_rates": r.tier_hit_rates(),
                    "seconds": round(r.seconds, 3),
                    **({"moves": r.detail["prefetch"]} if "prefetch" in r.detail else {}),
                }
                for mode, r in self.prefetch.items()
            }
        return out


def parse_tiers(spec: str) -> list[tuple[str, float]]:
    """``"cpu:1,disk:16"`` -> ``[("cpu", 1.0), ("disk", 16.0)]`` (names fastest first)."""
    tiers: list[tuple[str, float]] = []
    for part in spec.split(","):
        name, _, weight = part.strip().partition(":")
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            raise InvalidInput(f"bad tier weight in {part!r}: use name:weight") from None
        if not name or not value > 0:
            raise InvalidInput(f"bad tier {part!r}: use name:weight with a positive weight")
        tiers.append((name, value))
    if len({n for n, _ in tiers}) != len(tiers):
        raise InvalidInput(f"tier names must be unique in {spec!r}")
    return tiers


def split_capacity(total_blocks: int, tiers: Sequence[tuple[str, float]]) -> list[tuple[str, int]]:
    """Whole blocks per tier in proportion to the weights; the last tier takes the rest."""
    weight = sum(w for _, w in tiers)
    out: list[tuple[str, int]] = []
    left = total_blocks
    for i, (name, w) in enumerate(tiers):
        blocks = left if i == len(tiers) - 1 else min(left, int(total_blocks * w / weight))
        out.append((name, blocks))
        left -= blocks
    return out


def make_simulator(
    name: str, trace: Trace, tiers: Sequence[tuple[str, int]], *, prefetch: str | None = None
) -> Simulator:
    """The simulator of policy ``name`` over ``tiers`` (capacities in blocks); ``prefetch``:
    the node's prefetch mode (``PREFETCH_MODES``; the ``sessioncache`` policies only)."""
    if name == "oracle":
        return OracleSim()
    if name == "lru":
        return LruSim(name, tiers)
    if name == "lru_tail_first":
        return LruSim(name, tiers, tail_first=True)
    if name == "ttl_5min":
        return LruSim(name, tiers, ttl_s=TTL_5MIN_S)
    if name == "belady":
        return BeladySim(trace, sum(blocks for _, blocks in tiers))
    if name in ("sessioncache", "sessioncache_lru"):
        bt = trace.block_tokens
        policy = EvictionPolicy.named("forecast" if name == "sessioncache" else "lru", len(tiers))
        return StoreSim(
            name,
            [(t, blocks * bt) for t, blocks in tiers],
            block_bytes=bt,
            policy=policy,
            prefetch=prefetch,
            trace=trace,
        )
    raise InvalidInput(f"unknown policy {name!r}; policies are {[*POLICIES, *EXTRA_POLICIES]}")


class MissAttribution:
    """The replay's miss attribution, the service's reasons (``sessioncache/attribution.py``)
    computed from the trace: a missed block is ``diverged`` when its session's previous
    request had other content at that position (past the first differing block, within the
    previous request), else ``new`` the first time the trace names it, else it was held once
    and the simulator says why it left (``expired`` or ``evicted``; ``evicted`` when it cannot
    tell). Tokens past the last full block are ``new``."""

    def __init__(self, sim: Simulator, block_tokens: int) -> None:
        self._why: Callable[[int], str] | None = getattr(sim, "why_missing", None)
        self._bt = block_tokens
        self._seen: set[int] = set()
        self._prev: dict[str, tuple[int, ...]] = {}
        self.tokens: dict[str, int] = dict.fromkeys(("diverged", "evicted", "expired", "new"), 0)

    def add(self, request: Request, matched: int) -> None:
        ids, bt, tokens, seen = request.ids, self._bt, request.tokens, self._seen
        counts = self.tokens
        counts["new"] += max(0, tokens - len(ids) * bt)
        prev = self._prev.get(request.session) if request.session is not None else None
        k, prev_n = len(ids), 0
        if prev is not None:
            prev_n = len(prev)
            k = next((i for i, (a, b) in enumerate(zip(ids, prev, strict=False)) if a != b), k)
        for i in range(matched, len(ids)):
            n_tokens = min(bt, tokens - i * bt)
            if n_tokens <= 0:
                break
            block = ids[i]
            if k <= i < prev_n:
                reason = "diverged"
            elif block not in seen:
                reason = "new"
            else:
                reason = self._why(block) if self._why is not None else "evicted"
            counts[reason] += n_tokens
        seen.update(ids)
        if request.session is not None:
            self._prev[request.session] = ids


def replay_one(trace: Trace, sim: Simulator, progress: Progress | None = None) -> PolicyResult:
    """Serve every request of ``trace`` with ``sim`` and score it."""
    bt = trace.block_tokens
    names = sim.tier_names
    per_tier = [0] * len(names)
    hit_tokens = total = hit_blocks = 0
    pending = 0
    attribution = MissAttribution(sim, bt)
    finish: Callable[[Request], None] | None = getattr(sim, "finish", None)
    finishing: list[tuple[float, int, Request]] = []  # requests running, by end
    started = time.perf_counter()
    for seq, request in enumerate(trace.requests):
        while finishing and finishing[0][0] <= request.time:
            ended = heapq.heappop(finishing)[2]
            if finish is not None:
                finish(ended)  # revealed when the request ends, never before
        tiers = sim.serve(request)
        if request.stop is not None:
            heapq.heappush(finishing, (request.finished, seq, request))
        matched = len(tiers)
        total += request.tokens
        attribution.add(request, matched)
        if matched:
            hit = min(matched * bt, request.tokens)
            hit_tokens += hit
            hit_blocks += matched
            for index in range(len(names)):
                per_tier[index] += tiers.count(index) * bt
            per_tier[tiers[-1]] -= matched * bt - hit  # a partial last block
        pending += 1
        if progress is not None and pending >= 16:
            progress(pending)
            pending = 0
    if progress is not None and pending:
        progress(pending)
    seconds = time.perf_counter() - started
    detail = sim.detail()
    sim.close()
    return PolicyResult(
        sim.name,
        hit_tokens,
        total,
        dict(zip(names, per_tier, strict=True)),
        hit_blocks,
        len(trace.requests),
        seconds,
        detail,
        attribution.tokens,
    )


def capacity_tiers(
    trace: Trace, capacity_frac: float, tiers: Sequence[tuple[str, float]] = DEFAULT_TIERS
) -> list[tuple[str, int]]:
    if not capacity_frac > 0:
        raise InvalidInput(f"capacity_frac must be positive, got {capacity_frac}")
    total = max(1, round(capacity_frac * trace.unique_blocks))
    return split_capacity(total, tiers)


CODEC_TIERS = ("disk", "redis")
"""The tiers a block codec applies to (``sessioncache.codecs``)."""


def with_codec(split: Sequence[tuple[str, int]], ratio: float) -> list[tuple[str, int]]:
    """Each tier's capacity in blocks when the codec tiers store ``ratio`` times more blocks
    in the same bytes (a measured compression ratio)."""
    if not ratio > 0:
        raise InvalidInput(f"a codec ratio must be positive, got {ratio}")
    if not any(name in CODEC_TIERS for name, _ in split):
        raise InvalidInput(f"a codec ratio applies to the {' and '.join(CODEC_TIERS)} tiers")
    return [(n, int(b * ratio) if n in CODEC_TIERS else b) for n, b in split]


def run_replay(
    trace: Trace,
    *,
    capacity_frac: float = 0.05,
    tiers: Sequence[tuple[str, float]] = DEFAULT_TIERS,
    policies: Sequence[str] = POLICIES,
    progress: Progress | None = None,
    oracle: PolicyResult | None = None,
    codec_ratio: float | None = None,
    prefetch: Sequence[str] = (),
) -> ReplayReport:
    """Replay ``trace`` once per policy at the same capacity (``oracle``: reuse a result);
    ``codec_ratio``: the disk and Redis tiers' bytes hold that many times more blocks;
    ``prefetch``: also the node's default policy under each of these prefetch modes."""
    for mode in prefetch:
        if mode not in PREFETCH_MODES:
            raise InvalidInput(f"unknown prefetch {mode!r}; prefetch modes are {PREFETCH_MODES}")
    split = capacity_tiers(trace, capacity_frac, tiers)
    if codec_ratio is not None:
        split = with_codec(split, codec_ratio)
    results: dict[str, PolicyResult] = {}
    for name in policies:
        if name == "oracle" and oracle is not None:
            results[name] = oracle
            if progress is not None:
                progress(len(trace.requests))
            continue
        results[name] = replay_one(trace, make_simulator(name, trace, split), progress)
    prefetched: dict[str, PolicyResult] = {}
    for mode in prefetch:
        if mode == "none" and "sessioncache" in results:
            prefetched[mode] = results["sessioncache"]
            continue
        sim = make_simulator("sessioncache", trace, split, prefetch=mode)
        prefetched[mode] = replay_one(trace, sim, progress)
    return ReplayReport(trace, capacity_frac, split, results, prefetched)


def run_capacity_sweep(
    trace: Trace,
    fracs: Sequence[float],
    *,
    tiers: Sequence[tuple[str, float]] = DEFAULT_TIERS,
    policies: Sequence[str] = POLICIES,
    progress: Progress | None = None,
    oracle: PolicyResult | None = None,
) -> list[ReplayReport]:
    """One report per capacity fraction; the oracle (capacity-free) is replayed once."""
    reports: list[ReplayReport] = []
    for frac in fracs:
        report = run_replay(
            trace,
            capacity_frac=frac,
            tiers=tiers,
            policies=policies,
            progress=progress,
            oracle=oracle,
        )
        oracle = report.results.get("oracle", oracle)
        reports.append(report)
    return reports
