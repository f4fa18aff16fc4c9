"""When a session comes back: the return distribution behind session-aware eviction.

Think times are heavy-tailed (a tool call comes back in seconds, a user in minutes, hours or
never), so a single gap per finish reason is wrong for the tail. The forecast is a distribution
instead: per finish class, and per session, the time from a request's finish (or, while it
runs, its arrival) to the session's next request is

    P(the session comes back at all) = p;  given it does, log(gap) ~ Normal(mu, sigma)

(``Gap``: a log-normal with a mass at "never"). The class priors, one set for top-level
sessions and one for subagents, are fitted offline (``fit_gap``; ``python -m bench.forecast
--fit``); each session's own gaps move its parameters online, shrunk toward its class prior
with ``Forecast.shrink`` pseudo-observations (``Rhythm``).

Each block carries one number, its *key* (the index's ``next_use`` column; the larger, the
sooner it goes), set when its session's event is filed, and its last access. Three ways of
turning the distribution into a key, ``Forecast.mode``:

* ``next_use`` (Belady's rule on the distribution): the key is the date by which the session
  is back with probability ``quantile`` (none, and the block is dead, when it is less likely
  than that ever to come back), and the value at ``now`` is

      value = max(min(key, now + beyond x H), now + overdue x (now - last))

  the second term taking over once that date has passed without the session (think times
  are heavy-tailed: the longer it has been silent, the longer it is expected to stay so).
  ``H`` is the first tier's turnover time (``Horizon``): a return further ahead than
  ``beyond`` horizons, or none at all (dead), counts as that far only, since the tier would
  not keep the block until then anyway; such a block still goes before every block silent
  for less than ``beyond / overdue`` horizons, but after those silent longer, as under LRU.
  Two heaps serve it exactly: one on the key, one on last access.
* ``value`` (the expected value within the horizon): a block's worth ``s`` seconds after its
  session's last event is ``q(s) = P(return within H | silent s)``, ``H`` the first tier's
  turnover time (``Horizon``), times the tokens it saves per byte (equal for every block of a
  namespace). ``q`` changes as time passes, which a heap cannot follow, so each block gets a
  date when its event is filed: its *cold date* ``T = origin + s*``, ``s*`` the last silence
  at which ``q`` is at least the level an average block of age ``H`` has (the pooled prior's
  ``q(H)``, times ``threshold``). The key is ``-T``; a block no session names is cold at
  ``last + lru_horizons x H``. Exact while the ``q`` curves are shifts of one another; it is
  not when they cross (a tool loop is hotter than a finished turn for its first minutes,
  colder after), which is where it loses (docs/sessions.md).
* ``chance`` (hit density, exact where ``value`` is not): a block's worth ``s`` seconds after
  its session's last event is ``q(s)`` over the seconds it is expected to stay until that
  read or ``H``, whichever comes first (``hit_density``: hits per second held, as in Least
  Hit Density caching). The key names the event's class and date (``event_key``: the class's
  number times ``CLASS_SPAN`` plus the date), and the policy keeps two heaps per class,
  oldest event first and newest event first: within one class the density rises with silence
  while the return is still ahead (a tool's result takes seconds to come) and falls after it
  (a heavy tail's hazard does), so the least dense block of a class is the top of one of
  them, and the victim is the least dense of those tops (two per class), evaluated at
  ``now``. A hint's expected return is a
  class of its own (``dated_key``: the date); a block no session names is valued by the
  pooled prior at its silence. The priors may be histograms (``Hist``: the tail as seen,
  which a log-normal thins: a tool call an hour late).

Blocks no session names keep LRU's order among themselves, a dead block's key is
``ORPHAN_BASE - last`` (above every other: dead blocks leave first, the oldest first, but
where ``beyond`` caps them), and a new block starts with its parent's key. The default is
the mode and settings chosen by cross-validation (``bench.forecast --cv``).

What the forecast is made of, per session, from what the node sees online:

* a lookup or store of the session: a request has arrived (class ``flight``: the gap from one
  arrival to the next, its finish not known yet);
* the request's finish reason, where the engine or agent passes it (``tool``, ``stop``,
  ``length``, ``abort``): the gap from that finish to the next arrival;
* the session's own gaps of each class (``Rhythm``);
* whether it is a subagent (opened with a ``parent``): subagents have priors of their own (a
  subagent whose turn ended almost never comes back), and its filings spare the prefix it
  shares with its parent;
* close, and a prompt that left the previous one's chain: the blocks no live chain of the
  session reaches any more are dead, or valued as a return ``dead_branch_s`` away.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

from sessioncache.errors import InvalidInput
from sessioncache.store.gaps import BACK_SIGMA as BACK_SIGMA
from sessioncache.store.gaps import CLASSES as CLASSES
from sessioncache.store.gaps import DEFAULT_HIST_PRIORS as DEFAULT_HIST_PRIORS
from sessioncache.store.gaps import DEFAULT_HIST_SUBAGENT_PRIORS as DEFAULT_HIST_SUBAGENT_PRIORS
from sessioncache.store.gaps import DEFAULT_PRIORS as DEFAULT_PRIORS
from sessioncache.store.gaps import DEFAULT_SUBAGENT_PRIORS as DEFAULT_SUBAGENT_PRIORS
from sessioncache.store.gaps import FINISH_CLASSES as FINISH_CLASSES
from sessioncache.store.gaps import FINISH_REASON_PATTERN as FINISH_REASON_PATTERN
from sessioncache.store.gaps import FLIGHT as FLIGHT
from sessioncache.store.gaps import HIST_EDGES as HIST_EDGES
from sessioncache.store.gaps import MIN_GAP_S as MIN_GAP_S
from sessioncache.store.gaps import PER_E, dated_chance, density, round2
from sessioncache.store.gaps import POOLED as POOLED
from sessioncache.store.gaps import Distribution as Distribution
from sessioncache.store.gaps import Gap as Gap
from sessioncache.store.gaps import Hist as Hist
from sessioncache.store.gaps import finish_class as finish_class
from sessioncache.store.gaps import fit_gap as fit_gap
from sessioncache.store.gaps import fit_hist as fit_hist
from sessioncache.store.gaps import hit_density as hit_density

NO_FORECAST = float("-inf")
"""``next_use`` (the key) of a block nobody forecast (session-less, or touched and not filed
yet): it is cold ``lru_horizons`` horizons after its last access, as under LRU."""

ORPHAN_BASE = 1e15
"""The key of a block with no forecast at all, dead: ``ORPHAN_BASE - last`` (any real key is
far below it), so that such blocks leave before every other, the oldest first."""

MODES = ("value", "next_use", "chance")
CLASS_SPAN = 2.0**36
"""``chance``: a key is its class's number (``Forecast.classes``, from 1) times this, plus
the date of the event it dates from (seconds; below this)."""
DATED = "dated"
"""``chance``: the class of a chain dated by a hint (or a branch left): the key holds the date."""


class Horizon:
    """The first tier's turnover, as its evictions show it (the policy feeds it each one):

    * ``seconds``: how long the tier keeps a block at its current eviction rate: its capacity
      over the bytes evicted per second, measured over each sixteenth of the capacity evicted
      and smoothed (Little's law; not the victims' own ages, which the policy chooses);
    * ``level``: the return probability (within ``seconds``) at which blocks are evicted now.
      A victim taken before its cold date says the tier evicts hotter blocks than ``level``,
      one taken after it colder ones: ``level`` moves up or down by a factor ``1 + step``
      until victims leave at their cold dates (with ``adapt`` off it stays where it started).
    """

    __slots__ = ("_bytes", "_since", "adapt", "level", "rounded", "seconds", "step")

    def __init__(self, start: float, level: float = 0.0, *, step: float = 0.01) -> None:
        self.seconds = start
        self.rounded = round2(start)
        """``seconds`` to 2 significant digits (what hit densities are cached by)."""
        self.level = level
        self.step = step
        self.adapt = True
        self._bytes = 0
        self._since: float | None = None

    def evicted(self, nbytes: int, now: float, capacity: int, early: float | None) -> None:
        """A victim of ``nbytes`` left a tier of ``capacity`` bytes at ``now``; ``early``:
        seconds before its cold date it left (negative: after), for a victim a session
        forecast."""
        if self._since is None:
            self._since = now
        self._bytes += nbytes
        span = now - self._since
        if capacity > 0 and self._bytes * 16 >= capacity and span > 0:  # time has passed
            sample = span * capacity / self._bytes
            self.seconds += 0.25 * (max(1.0, sample) - self.seconds)
            self.rounded = round2(self.seconds)
            self._bytes, self._since = 0, now
        if early is not None and self.adapt and early != 0:
            factor = math.exp(self.step if early > 0 else -self.step)
            self.level = min(0.99, max(1e-4, self.level * factor))


@dataclass(frozen=True, slots=True)
class Forecast:
    """The forecast's settings (module docstring); chosen by cross-validation on the 301
    sessions of ``../shared/traces/agent-sessions-more`` (docs/sessions.md)."""

    priors: Mapping[str, Distribution] = field(default_factory=lambda: dict(DEFAULT_PRIORS))
    """Per class (``CLASSES`` and ``POOLED``), the prior of a top-level session's gap."""
    subagent_priors: Mapping[str, Distribution] = field(
        default_factory=lambda: dict(DEFAULT_SUBAGENT_PRIORS)
    )
    """The same for a subagent (a session opened with a ``parent``)."""
    shrink: float = math.inf
    """Pseudo-observations of the class prior against a session's own gaps of that class
    (inf: the class priors alone; cross-validation found a session's own gaps to hurt)."""
    mode: str = "next_use"
    """How the distribution becomes a key (module docstring, ``MODES``): ``next_use``
    (Belady's rule on its ``quantile``) or ``value`` (the cold date of the expected value
    within the horizon)."""
    quantile: float = 0.8
    """``next_use``: the quantile of the gap a session is expected back at (none when it is
    less likely than that ever to come back: dead)."""
    overdue: float = 4.0
    """``next_use``: how fast an expected return that did not come recedes: a block is valued
    at least ``now + overdue x (now - last access)``."""
    beyond: float = 1.0
    """``next_use``: a predicted return further ahead than this many horizons (the first
    tier's turnover, ``Horizon``), or none (a dead block), counts as that far only: the tier
    would not keep the block until then anyway, so blocks silent for longer than
    ``beyond / overdue`` horizons go before it (inf: no cap; dead blocks leave first)."""
    dead_branch_s: float | None = 3600.0
    """The blocks a session's new prompt left behind: valued as a return that many seconds
    from then (``next_use``; ``value``: cold then), since sessions do go back to an older
    branch; None: dead, they leave before everything. A closed session's chain is dead
    either way."""
    threshold: float = 1.0
    """``value``: a block is cold once its return within the horizon is less likely than
    ``threshold`` times an average block's of the horizon's age: where the level starts, and
    where it stays without ``adapt``."""
    adapt: bool = False
    """``value``: whether the level follows the tier's victims (``Horizon``)."""
    lru_horizons: float = 1.0
    """``value``: a block no session forecasts is cold that many horizons after its last
    access."""
    horizon_s: float = 600.0
    """``value`` and ``beyond``: the horizon before the first tier has evicted anything."""
    stopping: bool = False
    """``chance``: a block's worth is the best hit density over every horizon up to the
    tier's (the block may be let go at any silence, so a heavy tail costs only the wait that
    pays: a Gittins index), not the density over the tier's horizon alone."""
    horizon: Horizon = field(default=None, compare=False, repr=False)  # type: ignore[assignment]
    """The live horizon of the first tier (the policy updates it: not a setting)."""
    _densities: dict[tuple[int, int, float], float] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        for name, priors in (("priors", self.priors), ("subagent_priors", self.subagent_priors)):
            missing = {*CLASSES, POOLED} - set(priors)
            if missing:
                raise InvalidInput(f"a forecast's {name} need a gap for {sorted(missing)}")
        if not (self.shrink >= 0 and self.threshold > 0 and self.lru_horizons > 0):
            raise InvalidInput("shrink must be >= 0, threshold and lru_horizons positive")
        if not self.horizon_s > 0:
            raise InvalidInput("horizon_s must be positive")
        if self.dead_branch_s is not None and not self.dead_branch_s >= 0:
            raise InvalidInput("dead_branch_s must be >= 0")
        if self.mode not in MODES or not (0 < self.quantile < 1 and self.overdue > 0):
            raise InvalidInput(f"mode is one of {MODES}, 0 < quantile < 1, overdue > 0")
        if not self.beyond > 0:
            raise InvalidInput("beyond must be positive")
        if self.mode == "chance" and self.shrink != math.inf:
            raise InvalidInput("the chance mode keys blocks by class: shrink must be inf")
        gaps = (*self.priors.values(), *self.subagent_priors.values())
        if not all(isinstance(g, Gap) for g in gaps) and (
            self.mode == "value" or self.shrink != math.inf
        ):
            raise InvalidInput("histogram priors need shrink inf and the next_use or chance mode")
        if self.horizon is None:
            h = self.horizon_s
            level = min(0.99, self.threshold * self.priors[POOLED].returns_within(h, h))
            object.__setattr__(self, "horizon", Horizon(h, max(1e-4, level)))
            self.horizon.adapt = self.adapt

    def level(self) -> float:
        """The return probability below which a block is cold now (``Horizon.level``)."""
        return self.horizon.level

    def cold_key(self, gap: Distribution, origin: float) -> float:
        """The key (module docstring) of a block whose session's last event, at ``origin``,
        forecasts ``gap``: ``-T`` (``value``), or the predicted next use (``next_use``)."""
        if self.mode == "next_use":
            back = gap.quantile(self.quantile)
            return ORPHAN_BASE - origin if back is None else origin + back
        assert isinstance(gap, Gap)  # the value mode's priors are log-normals (checked)
        return -(origin + cold_after(gap, self.horizon.seconds, self.level()))

    def event_key(self, sub: bool, cls: str, gap: Distribution, origin: float) -> float:
        """The key of a block whose session's last event, at ``origin``, was of class ``cls``
        (a subagent's when ``sub``) and forecasts ``gap``."""
        if self.mode == "chance":
            return (self.classes.index((sub, cls)) + 1) * CLASS_SPAN + origin
        return self.cold_key(gap, origin)

    def dated_key(self, back: float, now: float) -> float:
        """``chance``: the key of a chain expected back at ``back``."""
        return (len(self.classes) + 1) * CLASS_SPAN + back

    @property
    def classes(self) -> tuple[tuple[bool, str], ...]:
        """``chance``: the classes a key names, in order (subagent?, class); the dated one
        after them."""
        return _CLASSES

    def class_of(self, key: float) -> int:
        """``chance``: the class number of a key (``classes``; ``len(classes)``: dated)."""
        return int(key // CLASS_SPAN) - 1

    def event_of(self, key: float) -> tuple[int, float]:
        """``chance``: a key's class number (``class_of``) and the date it holds."""
        c = self.class_of(key)
        return c, key - (c + 1) * CLASS_SPAN

    def class_gap(self, c: int) -> Distribution:
        """``chance``: the distribution of class ``c`` (``classes``; past them: the pooled
        prior)."""
        if c < len(self.classes):
            sub, cls = self.classes[c]
            return (self.subagent_priors if sub else self.priors)[cls]
        return self.priors[POOLED]

    def chance(self, key: float, last: float, now: float, horizon: Horizon | None = None) -> float:
        """``chance``: the block's hit density as of ``now``: the probability that it is read
        within ``horizon`` (the turnover of the tier it is in; None: the first tier's) over
        the time it is expected to stay until then (per second held); -1 for a dead one."""
        if key >= ORPHAN_BASE / 2:
            return -1.0
        horizon = horizon or self.horizon
        pooled = len(self.classes) + 1
        if key == NO_FORECAST:
            return self._density(pooled, now - last, horizon.rounded)
        c, origin = self.event_of(key)
        if c == len(self.classes):  # dated
            if origin < now:  # the date passed without the session: an average silence
                return self._density(pooled, now - origin, horizon.rounded)
            ahead, h = origin - now, horizon.seconds
            return dated_chance(ahead, h) / max(MIN_GAP_S, min(ahead, h))
        return self._density(c, now - origin, horizon.rounded)

    def _density(self, c: int, silent: float, h: float) -> float:
        """``hit_density`` of class ``c`` (``classes``; past them: the pooled prior) at
        ``silent`` within the horizon ``h`` (rounded), cached per class, silence bucket and
        horizon."""
        bucket = int(math.log(max(MIN_GAP_S, silent)) * PER_E)
        cached = self._densities.get((c, bucket, h))
        if cached is None:
            if len(self._densities) >= 1 << 16:
                self._densities.clear()
            cached = self._densities[(c, bucket, h)] = density(
                self.class_gap(c), bucket, h, self.stopping
            )
        return cached

    @property
    def gaps(self) -> dict[str, float]:
        """``next_use`` mode: seconds from a finish of each class to a new top-level session's
        predicted return (its prior's ``quantile``; the ``ORPHAN_BASE`` offset if none)."""
        return {cls: self.ahead(self.priors[cls]) for cls in CLASSES if cls != FLIGHT}

    @property
    def in_flight_s(self) -> float:
        """The same from a request's arrival, its finish not known yet."""
        return self.ahead(self.priors[FLIGHT])

    def ahead(self, gap: Distribution) -> float:
        back = gap.quantile(self.quantile)
        return ORPHAN_BASE if back is None else back

    def dead_branch_key(self, now: float) -> float:
        """The key of a branch the session left at ``now`` (``dead_branch_s``)."""
        assert self.dead_branch_s is not None
        if self.mode == "chance":
            return self.dated_key(now + self.dead_branch_s, now)
        if self.mode == "next_use":
            return now + self.dead_branch_s
        return -(now + self.dead_branch_s)

    def value(self, key: float, last: float, now: float, horizon: Horizon | None = None) -> float:
        """A block's eviction value at ``now`` in a tier of turnover ``horizon`` (None: the
        first tier's): the larger, the sooner it goes. ``value`` mode: its key's cold date,
        set at the first tier's horizon when the block's event was filed."""
        horizon = horizon or self.horizon
        if self.mode == "chance":
            return 1.0 - self.chance(key, last, now, horizon)
        if self.mode == "next_use" and self.beyond < math.inf:
            key = min(key, now + self.beyond * horizon.seconds)
        return self.predicted(key, last, now)

    def predicted(self, key: float, last: float, now: float) -> float:
        """``value`` before the ``beyond`` cap (``next_use``): the date a block is forecast
        back, which orders chains by their return however far ahead (the prefetch engine's
        order: under the cap every return past it ties). ``chance``: ``now`` plus the seconds
        held per hit (one over the hit density), in the eviction order."""
        if self.mode == "next_use":
            return max(key, now + self.overdue * (now - last))
        if self.mode == "chance":  # the seconds held per hit, from now: the eviction order
            if key >= ORPHAN_BASE / 2:
                return key
            return now + 1.0 / max(1e-12, self.chance(key, last, now))
        return eviction_value(key, last, self)

    def lru_cold(self, last_access: float) -> float:
        """The cold date of a block no session forecasts."""
        return last_access + self.lru_horizons * self.horizon.seconds


_CLASSES: tuple[tuple[bool, str], ...] = tuple((sub, c) for sub in (False, True) for c in CLASSES)


def node_forecast() -> Forecast:
    """The node's default forecast (``SESSIONCACHE_EVICTION_POLICY=forecast``), chosen by
    cross-validation (docs/sessions.md): hit density (``chance``) at its best stopping point
    (``stopping``) over the histogram priors, a branch a session left behind dead."""
    return Forecast(
        mode="chance",
        priors=dict(DEFAULT_HIST_PRIORS),
        subagent_priors=dict(DEFAULT_HIST_SUBAGENT_PRIORS),
        dead_branch_s=None,
        stopping=True,
    )


def cold_after(gap: Gap, horizon: float, level: float) -> float:
    """Seconds of silence after which ``gap.returns_within(silence, horizon)`` stays below
    ``level`` (the last crossing; 0 when it never reaches it: then less, down to ``-horizon``
    for a session that never comes back, so that the coldest go first)."""
    return _cold_after(gap.p, gap.mu, gap.sigma, round2(horizon), round2(level))


_GRID: tuple[float, ...] = (0.0, *(float(2.0 ** (k / 2)) for k in range(-2, 48)))  # 0 .. 137 d


@lru_cache(maxsize=65536)
def _cold_after(p: float, mu: float, sigma: float, horizon: float, level: float) -> float:
    gap = Gap(p, mu, sigma)
    q = [gap.returns_within(s, horizon) for s in _GRID]
    above = [i for i, v in enumerate(q) if v >= level]
    if not above:
        return -horizon * (1.0 - (q[0] / level if level > 0 else 0.0))
    i = above[-1]
    if i == len(_GRID) - 1:
        return _GRID[-1]
    lo, hi = _GRID[i], _GRID[i + 1]
    for _ in range(24):  # q(lo) >= level > q(hi)
        mid = 0.5 * (lo + hi)
        if gap.returns_within(mid, horizon) >= level:
            lo = mid
        else:
            hi = mid
    return lo


def eviction_value(key: float, last: float, forecast: Forecast) -> float:
    """A block's eviction value (the larger, the sooner it goes): its key, or for a block no
    session forecasts, minus its LRU cold date."""
    if key > NO_FORECAST:
        return key
    return -forecast.lru_cold(last)


_KEEP = 16


@dataclass(slots=True)
class Rhythm:
    """What a session has shown so far: when its last request arrived and finished, how, and
    the gaps it left after each class (the last few, as logarithms)."""

    arrived: float | None = None
    finished: float | None = None
    finish: str | None = None
    """The class of the last request's finish, once known; None while it runs."""
    gaps: dict[str, list[float]] = field(default_factory=dict)
    parent: tuple[str, str] | None = None
    """The (tenant, id) of the session it was forked from, if it said so."""

    def arrive(self, now: float) -> None:
        """A lookup or store: a request has arrived (its finish not known yet)."""
        if self.arrived is not None:
            self._saw(FLIGHT, now - self.arrived)
        if self.finish is not None and self.finished is not None:
            self._saw(self.finish, now - self.finished)
        self.arrived = now
        self.finish = None
        self.finished = None

    def _saw(self, cls: str, gap: float) -> None:
        seen = self.gaps.setdefault(cls, [])
        seen.append(math.log(max(MIN_GAP_S, gap)))
        del seen[:-_KEEP]

    def finished_with(self, cls: str, now: float) -> None:
        self.finish = cls
        self.finished = now

    def gap(self, forecast: Forecast, cls: str) -> Distribution:
        """The session's distribution after an event of class ``cls``: the class prior (the
        subagents' for a subagent) moved by its own gaps of that class."""
        priors = forecast.subagent_priors if self.parent is not None else forecast.priors
        prior = priors[cls]
        seen = self.gaps.get(cls)
        if not seen or forecast.shrink == float("inf") or not isinstance(prior, Gap):
            return prior
        n, k = len(seen), forecast.shrink
        mu = (k * prior.mu + sum(seen)) / (k + n)
        ss = sum((x - mu) ** 2 for x in seen)
        sigma = math.sqrt((k * (prior.sigma**2 + (prior.mu - mu) ** 2) + ss) / (k + n))
        p = (k * prior.p + n) / (k + n)
        return Gap(min(1.0, p), mu, max(0.1, sigma))

    def key_if(self, finish: str | None, forecast: Forecast, now: float) -> float:
        """The key (module docstring) as it would be were a request arriving now (``finish``
        None) or finishing now for that class."""
        cls = finish or FLIGHT
        return forecast.event_key(self.parent is not None, cls, self.gap(forecast, cls), now)

    def expected_back(self, forecast: Forecast, now: float) -> float:
        """When the session is expected back: its last event plus its gap's ``quantile`` (the
        date its blocks are evicted by, in the ``next_use`` mode), or the median of those who
        come back where there is none (or in the ``value`` mode). What pins that follow the
        forecast go by, in every mode."""
        if self.finish is not None and self.finished is not None:
            origin, gap = self.finished, self.gap(forecast, self.finish)
        else:
            origin = self.arrived if self.arrived is not None else now
            gap = self.gap(forecast, FLIGHT)
        back = gap.quantile(forecast.quantile) if forecast.mode != "value" else None
        return origin + (gap.median() if back is None else back)

    def key(self, forecast: Forecast, now: float) -> float:
        """The key of the session's chain, as of its last event (``now`` before any)."""
        sub = self.parent is not None
        if self.finish is not None and self.finished is not None:
            gap = self.gap(forecast, self.finish)
            return forecast.event_key(sub, self.finish, gap, self.finished)
        origin = self.arrived if self.arrived is not None else now
        return forecast.event_key(sub, FLIGHT, self.gap(forecast, FLIGHT), origin)
