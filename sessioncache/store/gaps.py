"""The time to a session's next request, as a distribution: the finish classes it is forecast
by, a log-normal with a mass at "never" (``Gap``) or a histogram (``Hist``), their fits, the
priors the node starts from, and hit density (what the ``chance`` eviction mode ranks by).
``sessioncache.store.forecast`` turns them into eviction keys (its docstring has the model).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

from sessioncache.errors import InvalidInput

FINISH_CLASSES: Mapping[str, str] = {
    "tool_use": "tool",
    "tool_calls": "tool",
    "tool_call": "tool",
    "function_call": "tool",
    "stop": "stop",
    "end_turn": "stop",
    "stop_sequence": "stop",
    "eos": "stop",
    "length": "length",
    "max_tokens": "length",
    "abort": "abort",
    "cancelled": "abort",
    "error": "abort",
}
"""The finish reasons a client may pass (vLLM's, OpenAI's and Anthropic's names), and the class
each forecasts by."""

FINISH_REASON_PATTERN = "^(" + "|".join(sorted(FINISH_CLASSES)) + ")$"
"""The same as a JSON-schema pattern."""

FLIGHT = "flight"
"""The class of a session whose request is running (arrived, finish not known yet)."""
POOLED = "pooled"
"""Every gap of every class: the reference an average block is measured by."""
CLASSES = ("tool", "stop", "length", "abort", FLIGHT)
"""The classes a session's gap is forecast by."""

MIN_GAP_S = 0.5
"""Gaps below this (a request arriving before the previous one's answer was read: parallel
tool calls) count as this, so that their logarithm stays finite."""


def finish_class(reason: str) -> str:
    """The class of a finish reason; ``InvalidInput`` (a 4xx) naming the accepted ones."""
    cls = FINISH_CLASSES.get(reason) if isinstance(reason, str) else None
    if cls is None:
        raise InvalidInput(
            f"unknown finish_reason {reason!r}; finish reasons are {sorted(FINISH_CLASSES)}"
        )
    return cls


_SQRT2 = math.sqrt(2.0)
_NORMAL = NormalDist()


@dataclass(frozen=True, slots=True)
class Gap:
    """The time to a session's next request: it comes back at all with probability ``p``,
    then after ``exp(Normal(mu, sigma))`` seconds."""

    p: float
    mu: float
    sigma: float

    def __post_init__(self) -> None:
        if not (0 < self.p <= 1 and self.sigma > 0 and math.isfinite(self.mu)):
            raise InvalidInput(f"a gap needs 0 < p <= 1, sigma > 0 and a finite mu: {self}")

    def survival(self, x: float) -> float:
        """P(no return within ``x`` seconds)."""
        if x <= 0:
            return 1.0
        z = (math.log(x) - self.mu) / self.sigma
        return 1.0 - self.p + self.p * 0.5 * math.erfc(z / _SQRT2)

    def returns_within(self, silent: float, horizon: float) -> float:
        """P(return within ``horizon`` more seconds | no return in the first ``silent``)."""
        alive = self.survival(silent)
        if alive <= 0:
            return 0.0
        return max(0.0, alive - self.survival(silent + horizon)) / alive

    def quantile(self, q: float) -> float | None:
        """The gap by which the session is back with probability ``q``; None when it is
        less likely to come back at all."""
        if self.p <= q:
            return None
        z = _NORMAL.inv_cdf(q / self.p)
        return math.exp(self.mu + self.sigma * z)

    def median(self) -> float:
        """The median gap of the sessions that do come back."""
        return math.exp(self.mu)


HIST_EDGES: tuple[float, ...] = tuple(float(2.0 ** (k / 2)) for k in range(-2, 41))
"""Where a ``Hist`` knows its survival: 0.5 s to 12 days, four points per power of 4."""


@dataclass(frozen=True, slots=True)
class Hist:
    """The time to a session's next request as a small histogram: ``surv[k]`` is P(no return
    within ``HIST_EDGES[k]`` seconds), linear in log time between edges; a return never comes
    with probability ``1 - p`` (the survival past the last edge). Heavy tails as they were
    seen, which a log-normal's thin tail is not (a tool call an hour late)."""

    surv: tuple[float, ...]

    def __post_init__(self) -> None:
        s = self.surv
        if len(s) != len(HIST_EDGES) or not all(0 < b <= a <= 1 for a, b in itertools.pairwise(s)):
            raise InvalidInput("a histogram needs one falling survival in (0, 1] per edge")

    @property
    def p(self) -> float:
        return 1.0 - self.surv[-1]

    def survival(self, x: float) -> float:
        """P(no return within ``x`` seconds)."""
        edges, surv = HIST_EDGES, self.surv
        if x <= edges[0]:
            return 1.0 - (1.0 - surv[0]) * max(0.0, x) / edges[0]
        if x >= edges[-1]:
            return surv[-1]
        k = bisect.bisect_right(edges, x) - 1
        t = (math.log(x) - math.log(edges[k])) / (math.log(edges[k + 1]) - math.log(edges[k]))
        return surv[k] + (surv[k + 1] - surv[k]) * t

    def returns_within(self, silent: float, horizon: float) -> float:
        """P(return within ``horizon`` more seconds | no return in the first ``silent``)."""
        alive = self.survival(silent)
        return max(0.0, alive - self.survival(silent + horizon)) / alive

    def quantile(self, q: float) -> float | None:
        """The gap by which the session is back with probability ``q``; None when it is
        less likely to come back at all."""
        if self.p <= q:
            return None
        target = 1.0 - q
        edges, surv = HIST_EDGES, self.surv
        if surv[0] <= target:
            return edges[0] * (1.0 - target) / (1.0 - surv[0])
        k = next(i for i, v in enumerate(surv) if v <= target) - 1
        t = (surv[k] - target) / (surv[k] - surv[k + 1])
        return math.exp(math.log(edges[k]) + t * (math.log(edges[k + 1]) - math.log(edges[k])))

    def median(self) -> float:
        """The median gap of the sessions that do come back."""
        back = self.quantile(self.p / 2)
        return HIST_EDGES[-1] if back is None else back


Distribution = Gap | Hist
"""A class's return distribution: fitted as a log-normal (``fit_gap``) or a histogram
(``fit_hist``)."""


def fit_hist(gaps: Sequence[float], events: int) -> Hist:
    """The ``Hist`` of ``gaps`` (seconds) seen after ``events`` events of a class, the others
    never followed by a request; each edge's survival is smoothed by half an event (a class
    never followed keeps a small chance of coming back, and none falls to 0)."""
    if events < len(gaps) or events <= 0:
        raise InvalidInput("fit_hist needs at least one event and no more gaps than events")
    ordered = sorted(gaps)
    n = len(ordered)
    surv = []
    for edge in HIST_EDGES:
        later = n - bisect.bisect_right(ordered, edge)
        surv.append((0.5 + events - n + later) / (events + 1))
    return Hist(tuple(surv))


def fit_gap(gaps: Sequence[float], events: int, *, like: Gap | None = None) -> Gap:
    """The maximum-likelihood ``Gap`` of ``gaps`` (seconds; each at least ``MIN_GAP_S``) seen
    after ``events`` events of a class, the others never followed by a request; ``p`` is
    smoothed (half an event each way), so that a class never followed keeps a small one and
    takes its log-normal from ``like``."""
    if events < len(gaps) or not (gaps or like is not None):
        raise InvalidInput("fit_gap needs no more gaps than events, and gaps or a like")
    p = (len(gaps) + 0.5) / (events + 1)
    if not gaps:
        assert like is not None
        return Gap(p, like.mu, like.sigma)
    logs = [math.log(max(MIN_GAP_S, g)) for g in gaps]
    mu = sum(logs) / len(logs)
    var = sum((x - mu) ** 2 for x in logs) / len(logs)
    return Gap(p, mu, max(0.1, math.sqrt(var)))


def hist_of(survivals: str) -> Hist:
    """A ``Hist`` from its survivals, written out (one per ``HIST_EDGES`` edge)."""
    return Hist(tuple(float(x) for x in survivals.split()))


# Fitted on all 301 sessions of ../shared/traces/agent-sessions-more (``python -m
# bench.forecast --fit``): (p, mu, sigma) per class, for top-level sessions and subagents.
DEFAULT_PRIORS: Mapping[str, Gap] = {
    "tool": Gap(0.9926, 2.5208, 1.2527),
    "stop": Gap(0.8751, 5.3794, 2.2901),
    "length": Gap(0.9851, 2.6829, 1.4881),
    "abort": Gap(0.9851, 2.6829, 1.4881),
    FLIGHT: Gap(0.9855, 3.2399, 1.2392),
    POOLED: Gap(0.9851, 2.6829, 1.4881),
}
"""The class priors of a top-level session (``length`` and ``abort``, never seen in the
sample, take the pooled gap)."""
DEFAULT_SUBAGENT_PRIORS: Mapping[str, Gap] = {
    "tool": Gap(0.9983, 1.6147, 0.8364),
    "stop": Gap(0.0172, 1.6147, 0.8364),
    "length": Gap(0.9134, 1.6147, 0.8364),
    "abort": Gap(0.9134, 1.6147, 0.8364),
    FLIGHT: Gap(0.9134, 2.1597, 0.6733),
    POOLED: Gap(0.9134, 1.6147, 0.8364),
}
"""The same for subagents: one whose turn ended almost never comes back."""

# The node's default (``node_forecast``): the same, as histograms where a class was seen followed
# 20 times or more (``python -m bench.forecast --fit --hist``); the subagents' finished turns
# (seldom followed) keep their log-normal, the classes never seen take the pooled gap.
_TOP_POOLED = hist_of(
    "0.9972 0.9968 0.9962 0.9958 0.9942 0.9803 0.9015 0.7299 0.5608 0.4309 0.3351 0.2708 "
    "0.2278 0.1915 0.1668 0.141 0.1102 0.08966 0.07392 0.0598 0.05127 0.03993 0.03454 "
    "0.03051 0.02722 0.02288 0.02011 0.01922 0.01791 0.01728 0.01634 0.01613 0.01592 0.0154 "
    "0.01519 0.01488 0.01488 0.01488 0.01488 0.01488 0.01488 0.01488 0.01488"
)
DEFAULT_HIST_PRIORS: Mapping[str, Distribution] = {
    "tool": hist_of(
        "0.9972 0.9968 0.9962 0.9958 0.9943 0.9805 0.8985 0.7174 0.5383 0.4007 0.2994 0.2314 "
        "0.1866 0.1493 0.1249 0.1001 0.07119 0.05443 0.04192 0.03097 0.02555 0.01628 0.01354 "
        "0.01209 0.0112 0.009244 0.008015 0.007792 0.007569 0.007457 0.007457 0.007457 0.007457 "
        "0.007401 0.007401 0.007401 0.007401 0.007401 0.007401 0.007401 0.007401 0.007401 "
        "0.007401"
    ),
    "stop": hist_of(
        "0.9963 0.9963 0.9963 0.9955 0.9914 0.9767 0.9447 0.9128 0.8907 0.8735 0.8595 0.8489 "
        "0.8309 0.8104 0.7817 0.7416 0.6826 0.6065 0.5434 0.4828 0.4287 0.387 0.3428 0.301 "
        "0.2625 0.2232 0.1978 0.1871 0.1699 0.1618 0.147 0.1437 0.1405 0.1331 0.1298 0.1249 "
        "0.1249 0.1249 0.1249 0.1249 0.1249 0.1249 0.1249"
    ),
    "length": _TOP_POOLED,
    "abort": _TOP_POOLED,
    FLIGHT: hist_of(
        "1 1 1 1 0.9999 0.9999 0.9987 0.9926 0.8984 0.7384 0.5415 0.4078 0.3044 0.233 0.1874 "
        "0.1493 0.1202 0.09072 0.07317 0.05885 0.05006 0.03895 0.03367 0.02944 0.02612 0.02228 "
        "0.0193 0.01848 0.01728 0.0167 0.01584 0.01564 0.01545 0.01497 0.01478 0.01449 0.01449 "
        "0.01449 0.01449 0.01449 0.01449 0.01449 0.01449"
    ),
    POOLED: _TOP_POOLED,
}
"""The node's default priors of a top-level session."""
_SUB_POOLED = hist_of(
    "0.9985 0.9954 0.9894 0.9802 0.9407 0.8191 0.5729 0.3723 0.2447 0.196 0.1839 0.1657 "
    "0.1383 0.1109 0.09574 0.0927 0.08663 0.08663 0.08663 0.08663 0.08663 0.08663 0.08663 "
    "0.08663 0.08663 0.08663 0.08663 0.08663 0.08663 0.08663 0.08663 0.08663 0.08663 "
    "0.08663 0.08663 0.08663 0.08663 0.08663 0.08663 0.08663 0.08663 0.08663 0.08663"
)
DEFAULT_HIST_SUBAGENT_PRIORS: Mapping[str, Distribution] = {
    "tool": hist_of(
        "0.9983 0.995 0.9884 0.9784 0.9352 0.8023 0.5332 0.314 0.1744 0.1213 0.108 0.08804 "
        "0.05814 0.02824 0.01163 0.008306 0.001661 0.001661 0.001661 0.001661 0.001661 0.001661 "
        "0.001661 0.001661 0.001661 0.001661 0.001661 0.001661 0.001661 0.001661 0.001661 "
        "0.001661 0.001661 0.001661 0.001661 0.001661 0.001661 0.001661 0.001661 0.001661 "
        "0.001661 0.001661 0.001661"
    ),
    "stop": Gap(0.0172, 1.6147, 0.8364),
    "length": _SUB_POOLED,
    "abort": _SUB_POOLED,
    FLIGHT: hist_of(
        "0.9985 0.9985 0.9985 0.9985 0.9954 0.9954 0.9043 0.7766 0.4514 0.3085 0.2052 0.19 "
        "0.1474 0.114 0.09878 0.0927 0.08967 0.08663 0.08663 0.08663 0.08663 0.08663 0.08663 "
        "0.08663 0.08663 0.08663 0.08663 0.08663 0.08663 0.08663 0.08663 0.08663 0.08663 "
        "0.08663 0.08663 0.08663 0.08663 0.08663 0.08663 0.08663 0.08663 0.08663 0.08663"
    ),
    POOLED: _SUB_POOLED,
}
"""The same for subagents."""


BACK_SIGMA = 0.25
"""The spread (log) of a return a hint dates (``value`` and ``chance`` modes)."""
_STEPS = 24
PER_E = 32
"""Silence buckets per factor e (about 3% apart): what hit densities are cached by."""


def hit_density(
    gap: Distribution, silent: float, horizon: float, *, stopping: bool = False
) -> float:
    """Hits per second held: ``P(read within horizon | silent)`` over the seconds a block is
    expected to stay until that read or the horizon, whichever comes first (``chance``; the
    silence to ~3%, the horizon to 2 digits); with ``stopping``, the best of that over every
    horizon up to ``horizon``."""
    bucket = int(math.log(max(MIN_GAP_S, silent)) * PER_E)
    return density(gap, bucket, round2(horizon), stopping)


def density(gap: Distribution, bucket: int, horizon: float, stopping: bool = False) -> float:
    """``hit_density`` at the silence of ``bucket``; with ``stopping``, the best of it over
    every horizon up to ``horizon`` (``Forecast.stopping``)."""
    s = math.exp(bucket / PER_E)
    alive = gap.survival(s)
    if alive <= 0 or horizon <= 0:
        return 0.0
    if stopping:
        n = max(1, math.ceil(4 * math.log(max(1.0, horizon / MIN_GAP_S))))
        points = [0.0, *(MIN_GAP_S * math.exp(k / 4) for k in range(n)), horizon]
        points = [p for p in points if p <= horizon]
    else:
        points = [0.0, *(horizon * math.exp((k - _STEPS) / 4) for k in range(_STEPS + 1))]
    held, prev, best = 0.0, alive, 0.0
    for lo, hi in itertools.pairwise(points):  # the expected stay: survival, integrated
        cur = gap.survival(s + hi)
        held += 0.5 * (prev + cur) * (hi - lo)
        prev = cur
        if stopping and held > 0:
            best = max(best, (alive - cur) / held)
    return best if stopping else (alive - prev) / held


def dated_chance(ahead: float, horizon: float) -> float:
    """The probability that a return expected ``ahead`` seconds from now falls within
    ``horizon`` (a log-normal of spread ``BACK_SIGMA`` about it)."""
    z = (math.log(max(MIN_GAP_S, horizon)) - math.log(max(MIN_GAP_S, ahead))) / BACK_SIGMA
    return 0.999 * 0.5 * math.erfc(-z / _SQRT2)


def round2(x: float) -> float:
    """``x`` to 2 significant digits: the horizon and the level drift; cold dates need not
    follow every step (and so are mostly cached)."""
    if x <= 0:
        return 0.0
    return float(f"{x:.2g}")
