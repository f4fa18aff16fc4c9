"""When a session comes back: the next-use forecast behind session-aware eviction.

The eviction order (``sessioncache.store.eviction``) is Belady's with predictions: of the evictable
chain tails, the one whose predicted next use lies furthest ahead leaves first. This module
holds the prediction and the priority, as pure functions over a few numbers per block; the
heaps that serve them are the policy's.

A block keeps two times: ``last`` (its last access) and ``next_use`` (when it is predicted to
be read again, set by whoever touched it last). Its eviction value at ``now`` is

    value = max(next_use, now + overdue * (now - last))

the larger, the sooner it goes. The first term is the forecast; the second is what is left of
it once a forecast has passed without the session coming back: think times are heavy-tailed,
so the longer a session has been silent, the longer it is expected to stay so (LRU's rule,
which is this term alone). A max of a fixed key and a key that is monotone in ``last`` is
served exactly by two heaps (one on ``next_use``, one on ``last``): the larger of their two
tops is the victim.

What a forecast is made of (``Forecast``), per session, from what the node sees online:

* a lookup or store of the session: a request has arrived; its answer is not known yet, so the
  session is expected back after a request's duration and an unknown gap (``in_flight_s``);
* the request's finish reason, where the engine or agent passes it (``finish_reason`` on a
  session's store, or ``SessionManager.record``): after a tool call the agent comes back in
  seconds, with the tool's result; after a turn that ended for the user, in minutes or days
  (``gaps``, seconds per finish class);
* its own rhythm: the gaps this session has shown after each finish class, blended in once it
  has shown a few (``Rhythm``);
* close, and a prompt that diverged from the session's previous one: the blocks no live chain
  of the session reaches any more are dead (``next_use = ORPHAN_BASE - last``) and leave
  first, oldest first, up to the last fork (blocks before it are another branch's too); a
  subagent's close spares the prefix it shares with its parent session.

Two kinds of block have no forecast of their own. A touch without a session leaves an
*unknown* one (``NO_FORECAST``: the value is the overdue term alone), so blocks no session
names are ordered among themselves exactly as LRU orders them. A block being stored starts
with its writer session's forecast, else its parent's: in the last tier, a store whose own
chain is expected back after every other tail there is cut short (the parent rule of
``EvictionPolicy.admits``: Belady's bypass), where LRU would have evicted another's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

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

NO_FORECAST = float("-inf")
"""``next_use`` of a block nobody forecast (session-less, or touched and not filed yet)."""

ORPHAN_BASE = 1e15
"""``next_use`` of a block with no forecast: ``ORPHAN_BASE - last`` (any real time is far
below it), so that such blocks leave before every forecast one, the oldest first."""


def finish_class(reason: str) -> str:
    """The class of a finish reason; ``InvalidInput`` (a 4xx) naming the accepted ones."""
    cls = FINISH_CLASSES.get(reason) if isinstance(reason, str) else None
    if cls is None:
        raise InvalidInput(
            f"unknown finish_reason {reason!r}; finish reasons are {sorted(FINISH_CLASSES)}"
        )
    return cls


def eviction_value(next_use: float, last: float, now: float, overdue: float) -> float:
    """A block's eviction value at ``now`` (module docstring): the larger, the sooner it goes."""
    return max(next_use, now + overdue * (now - last))


DEFAULT_GAPS: Mapping[str, float] = {
    "tool": 15.0,
    "stop": 600.0,
    "length": 60.0,
    "abort": 600.0,
}


@dataclass(frozen=True, slots=True)
class Forecast:
    """The forecast's settings (module docstring); tuned on half of the shared agentic
    sessions (docs/sessions.md)."""

    gaps: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_GAPS))
    """Seconds from a request's finish to the session's next request, per finish class."""
    in_flight_s: float = 40.0
    """Seconds from a request's arrival to the session's next one, the finish not known yet
    (a request's duration plus a gap)."""
    overdue: float = 4.0
    """How fast an expected return that did not come recedes (module docstring)."""
    dead_branch_s: float | None = 3600.0
    """The forecast of a previous prompt's blocks that the session's new prompt left: that
    many seconds ahead (a session may go back to an older branch), or None for none at all
    (they leave first). A closed session's chain has none either way."""
    rhythm_weight: float = 0.0
    """How much a session's own median gap (per finish class) counts against ``gaps`` once it
    has shown ``rhythm_after`` of them; 0 ignores rhythm."""
    rhythm_after: int = 3

    def __post_init__(self) -> None:
        if not self.in_flight_s > 0 or not self.overdue > 0:
            raise InvalidInput("a forecast's in_flight_s and overdue must be positive")
        if set(self.gaps) != set(DEFAULT_GAPS) or any(not g > 0 for g in self.gaps.values()):
            raise InvalidInput(f"a forecast needs a positive gap for each of {set(DEFAULT_GAPS)}")
        if self.dead_branch_s is not None and not self.dead_branch_s > 0:
            raise InvalidInput("dead_branch_s must be positive")
        if not 0 <= self.rhythm_weight <= 1:
            raise InvalidInput("rhythm_weight must be within [0, 1]")


_RHYTHM_KEEP = 16


@dataclass(slots=True)
class Rhythm:
    """What a session has shown so far: when its last request arrived and finished, how, and
    the gaps it left after each finish class (the last few)."""

    arrived: float | None = None
    finished: float | None = None
    finish: str | None = None
    """The class of the last request's finish, once known; None while it runs."""
    gaps: dict[str, list[float]] = field(default_factory=dict)
    parent: tuple[str, str] | None = None
    """The (tenant, id) of the session it was forked from, if it said so."""

    def arrive(self, now: float) -> None:
        """A lookup or store: a request has arrived (its finish not known yet)."""
        if self.finish is not None and self.finished is not None:
            seen = self.gaps.setdefault(self.finish, [])
            seen.append(max(0.0, now - self.finished))
            del seen[:-_RHYTHM_KEEP]
        self.arrived = now
        self.finish = None
        self.finished = None

    def finished_with(self, cls: str, now: float) -> None:
        self.finish = cls
        self.finished = now

    def next_use_if(self, finish: str | None, forecast: Forecast, now: float) -> float:
        """``next_use`` as it would be were a request arriving now (``finish`` None) or
        finishing now for that class."""
        if finish is None:
            return now + forecast.in_flight_s
        return now + self._gap(forecast, finish)

    def next_use(self, forecast: Forecast, now: float) -> float:
        """When the session is expected back, seen at ``now``."""
        if self.finish is None or self.finished is None:
            return (self.arrived if self.arrived is not None else now) + forecast.in_flight_s
        return self.finished + self._gap(forecast, self.finish)

    def _gap(self, forecast: Forecast, finish: str) -> float:
        """The gap after a finish of class ``finish``: the setting's, blended with the
        session's own median once it has shown enough of them."""
        gap = forecast.gaps[finish]
        seen = self.gaps.get(finish)
        if forecast.rhythm_weight and seen and len(seen) >= forecast.rhythm_after:
            own = sorted(seen)[len(seen) // 2]
            gap = forecast.rhythm_weight * own + (1 - forecast.rhythm_weight) * gap
        return gap
