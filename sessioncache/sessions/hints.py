"""Agent hints: what engines, routers and agent frameworks say about a session, in the field's
formats, mapped onto one ``Hint`` the session model acts on (``SessionManager.hint``).

One parser per format, each reading the fields its format defines (unknown fields are left
alone: the formats grow) and raising ``InvalidInput`` (a 4xx) for a field of the wrong type or
out of its range; a new format is one more parser in ``PARSERS``:

* ``agent_hint`` as uni-agent sends it in ``kv_transfer_params`` (``schema_version: 1``,
  ``trajectory_id``, ``kv_priority``, ``lease_until`` in epoch seconds, ``tools_available``);
* ``agent_hint`` with vLLM's agent-hint fields (``session_id``, ``parent_session_id``,
  ``cache_control.ttl`` in seconds, default 300 and at most 3,600, and ``edits`` of type
  ``evict``, ``offload`` or ``prefetch`` over ``block_start`` .. ``block_end``);
* ``agent_hints`` with SGLang's names (``cache_ttl_ms``, ``reuse_hint`` keep / neutral /
  discard, ``expected_tool_duration_ms``, ``workflow_id``, ``agent_id``, ``step_id``,
  ``parent_step_id``, and ``prefetch``);
* in either object, ``final`` (true or false): Dynamo's signal that the session is
  done, as a router forwards it;
* ``retention_directives`` (``[{start, end | null, priority 0-100, duration s}]`` over token
  positions, priority non-increasing with position) and ``retention_scope``, as vLLM's
  ``SamplingParams.extra_args`` carry them.

A body may carry several of them (a router forwards a request's ``kv_transfer_params`` whole):
``parse_hints`` merges them, a later format's field over an earlier's. What each field does
to the session is ``SessionManager.hint``'s (docs/sessions.md, "Agent hints").
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from sessioncache.errors import InvalidInput

NEUTRAL = 50
"""The priority of a session no hint ranks: its forecast alone orders its blocks."""
KEEP = 100
DISCARD = 0
PRIORITY_NAMES: Mapping[str, int] = {
    "discard": DISCARD,
    "low": 25,
    "neutral": NEUTRAL,
    "normal": NEUTRAL,
    "high": 75,
    "keep": KEEP,
}
"""Named priorities (SGLang's ``reuse_hint``, and names a ``kv_priority`` may take)."""
DEFAULT_CACHE_TTL_S = 300.0
MAX_CACHE_TTL_S = 3600.0
"""``cache_control.ttl``'s default and bound in vLLM's agent hint."""
EDITS = ("evict", "offload", "prefetch")
UNI_AGENT = ("schema_version", "trajectory_id", "kv_priority", "lease_until")
"""The fields that make an ``agent_hint`` uni-agent's."""


@dataclass(frozen=True, slots=True)
class Span:
    """Blocks ``start`` .. ``end`` (exclusive; None: to the end) of the session's chain, and
    the priority they are kept by (0: offloaded first)."""

    start: int
    end: int | None
    priority: int


@dataclass(frozen=True, slots=True)
class Hint:
    """What a hint says, in the node's terms (None: it says nothing of that)."""

    ttl_s: float | None = None
    """A soft TTL: keep the session's chain pinned this long after its last activity."""
    priority: int | None = None
    """0 .. 100 (``NEUTRAL`` 50): how long, beside its forecast, its blocks are kept."""
    final: bool | None = None
    """True: the session is done (unpinned now, its chain leaves first); False: it is not."""
    discard: bool = False
    """Unpin its chain now (its blocks then leave by their priority)."""
    back_in_s: float | None = None
    """When the session is expected back, seconds from now (a tool's duration, a lease)."""
    parent: str | None = None
    """The session it was forked from (a subagent's): the prefix they share is the parent's."""
    prefetch: bool = False
    """Bring its chain into the first tier ahead of its return."""
    evict: tuple[Span, ...] = ()
    """Blocks of its chain to let go now (unpinned, leaving first)."""
    spans: tuple[Span, ...] = ()
    """Blocks of its chain kept by their own priority (offloads, retention directives)."""
    session_id: str | None = None
    """The session the hint names in its own fields (a connector's fallback)."""

    def merged(self, other: Hint) -> Hint:
        """This hint with the fields ``other`` says something of taken from it."""
        unsaid: dict[str, object] = {"discard": False, "prefetch": False, "evict": (), "spans": ()}
        given = {
            f.name: getattr(other, f.name)
            for f in fields(other)
            if getattr(other, f.name) is not None and getattr(other, f.name) != unsaid.get(f.name)
        }
        return replace(self, **given)


@dataclass(slots=True)
class HintState:
    """A session's hints as they stand (soft state, as its forecast: a restart forgets it).
    Each hint changes what it says something of."""

    ttl_s: float | None = None
    """The soft TTL, capped (``apply``)."""
    since: float = 0.0
    """When the soft TTL was given: the pins hold ``ttl_s`` past this or the session's last
    activity, whichever is later."""
    priority: int | None = None
    final: bool = False
    back_at: float | None = None
    """When the session is expected back (epoch seconds); it lapses once passed."""
    spans: tuple[Span, ...] = ()

    def apply(self, hint: Hint, now: float, max_ttl_s: float) -> None:
        """Take ``hint`` at ``now``; its TTL is capped at ``max_ttl_s``."""
        if hint.ttl_s is not None:
            self.ttl_s = min(hint.ttl_s, max_ttl_s)
            self.since = now
        if hint.priority is not None:
            self.priority = hint.priority
        if hint.final is not None:
            self.final = hint.final
        if hint.back_in_s is not None:
            self.back_at = now + hint.back_in_s
        if hint.spans:
            self.spans = hint.spans

    def expected_at(self, now: float) -> float | None:
        """When the session is expected back, if a hint said so and it has not passed."""
        if self.back_at is not None and self.back_at < now:
            self.back_at = None
        return self.back_at

    def arrived(self) -> None:
        """A request of the session arrived: the return a hint expected has come (early or on
        time), so it no longer dates the chain, which the request now uses."""
        self.back_at = None

    def as_json(self) -> dict[str, Any]:
        return {
            "ttl_s": self.ttl_s,
            "priority": self.priority,
            "final": self.final,
            "back_at": self.back_at,
        }


class HintStates:
    """The hints of a node's open sessions as they stand (a ``HintState`` per session key),
    read and changed under the session manager's ``lock``; a hint's TTL is capped at
    ``max_ttl_s`` and at its session's own TTL."""

    def __init__(self, max_ttl_s: float, lock: threading.RLock) -> None:
        self.max_ttl_s = max_ttl_s
        self._lock = lock
        self._states: dict[tuple[str, str], HintState] = {}

    def get(self, key: tuple[str, str]) -> HintState | None:
        """The session's state itself (lock held by the caller), None: no hint."""
        return self._states.get(key)

    def snapshot(self, key: tuple[str, str]) -> HintState | None:
        """A copy of the session's state, taken under the lock (None: no hint)."""
        with self._lock:
            state = self._states.get(key)
            return replace(state) if state is not None else None

    def apply(self, key: tuple[str, str], hint: Hint, now: float, ttl_s: float) -> HintState:
        """Take ``hint`` for the session of TTL ``ttl_s`` (lock held by the caller)."""
        state = self._states.setdefault(key, HintState())
        state.apply(hint, now, min(self.max_ttl_s, ttl_s))
        return state

    def forget(self, key: tuple[str, str]) -> None:
        self._states.pop(key, None)

    def idle_due(self, key: tuple[str, str], last_seen: float, idle_timeout_s: float) -> float:
        """When the session's pins go idle: its soft TTL past its last activity (or the
        hint's, if later), else ``idle_timeout_s`` past its last activity."""
        state = self._states.get(key)
        if state is not None and state.ttl_s is not None:
            return max(last_seen, state.since) + state.ttl_s
        return last_seen + idle_timeout_s


Parser = Callable[[Mapping[str, Any], float, int | None], Hint]
"""A format's parser: its object, the node's ``now`` (epoch seconds) and the engine's tokens
per block (None: unknown) to the ``Hint`` it says."""


def parse_hints(body: Mapping[str, Any], now: float, block_tokens: int | None = None) -> Hint:
    """The hint of every format ``body`` carries (``PARSERS``' keys), merged;
    ``InvalidInput`` when it carries none or one is malformed."""
    if not isinstance(body, Mapping):
        raise InvalidInput("a hint body is a JSON object")
    found = [name for name in PARSERS if body.get(name) is not None]
    if not found:
        raise InvalidInput(f"no hint: a hint body carries one of {sorted(PARSERS)}")
    hint = Hint()
    for name in found:
        hint = hint.merged(PARSERS[name](body, now, block_tokens))
    return hint


def has_hints(body: Mapping[str, Any] | None) -> bool:
    """Whether ``body`` carries a hint of some format."""
    return isinstance(body, Mapping) and any(body.get(name) is not None for name in PARSERS)


# -- the formats ------------------------------------------------------------------------------


def agent_hint(body: Mapping[str, Any], now: float, block_tokens: int | None) -> Hint:
    """``agent_hint``: uni-agent's schema when it has its fields (``schema_version``,
    ``trajectory_id``, ``kv_priority``, ``lease_until``), else vLLM's agent-hint fields."""
    obj = _object(body, "agent_hint")
    if any(obj.get(k) is not None for k in UNI_AGENT):
        return uni_agent_hint(obj, now)
    return vllm_agent_hint(obj)


def uni_agent_hint(obj: Mapping[str, Any], now: float) -> Hint:
    where = "agent_hint"
    version = obj.get("schema_version", 1)
    if version != 1 or isinstance(version, bool):
        raise InvalidInput(f"{where}.schema_version: only version 1 is known, got {version!r}")
    trajectory = _text(obj, "trajectory_id", where)
    _texts(obj, "tools_available", where)
    lease = _number(obj, "lease_until", where)
    priority = _priority(obj.get("kv_priority"), f"{where}.kv_priority")
    return Hint(
        priority=priority,
        final=_flag(obj, "final", where),
        discard=obj.get("kv_priority") == "discard",
        back_in_s=None if lease is None else max(0.0, lease - now),
        session_id=trajectory,
    )


def vllm_agent_hint(obj: Mapping[str, Any]) -> Hint:
    where = "agent_hint"
    session = _text(obj, "session_id", where)
    parent = _text(obj, "parent_session_id", where)
    ttl = None
    if obj.get("cache_control") is not None:
        control = _object(obj, "cache_control", where)
        ttl = _number(control, "ttl", f"{where}.cache_control")
        ttl = DEFAULT_CACHE_TTL_S if ttl is None else ttl
        if not 0 < ttl <= MAX_CACHE_TTL_S:
            raise InvalidInput(
                f"{where}.cache_control.ttl is seconds in (0, {MAX_CACHE_TTL_S:.0f}], got {ttl}"
            )
    edits = obj.get("edits")
    if edits is not None and not isinstance(edits, list):
        raise InvalidInput(f"{where}.edits is a list")
    evict: list[Span] = []
    offload: list[Span] = []
    prefetch = False
    for i, edit in enumerate(edits or ()):
        at = f"{where}.edits[{i}]"
        if not isinstance(edit, Mapping):
            raise InvalidInput(f"{at} is an object")
        kind = edit.get("type")
        if kind not in EDITS:
            raise InvalidInput(f"{at}.type is one of {list(EDITS)}, got {kind!r}")
        start = _count(edit, "block_start", at) or 0
        end = _count(edit, "block_end", at)
        if end is not None and end <= start and kind != "prefetch":
            continue  # no block
        if kind == "evict":
            evict.append(Span(start, end, DISCARD))
        elif kind == "offload":
            offload.append(Span(start, end, DISCARD))
        else:
            prefetch = True
    return Hint(
        ttl_s=ttl,
        final=_flag(obj, "final", where),
        parent=parent,
        prefetch=prefetch,
        evict=tuple(evict),
        spans=tuple(offload),
        session_id=session,
    )


def sglang_agent_hints(body: Mapping[str, Any], now: float, block_tokens: int | None) -> Hint:
    """``agent_hints``, SGLang's names."""
    where = "agent_hints"
    obj = _object(body, where)
    for name in ("agent_id", "step_id", "parent_step_id"):
        _text(obj, name, where, ids=True)
    workflow = _text(obj, "workflow_id", where, ids=True)
    ttl_ms = _number(obj, "cache_ttl_ms", where)
    if ttl_ms is not None and not ttl_ms > 0:
        raise InvalidInput(f"{where}.cache_ttl_ms must be positive, got {ttl_ms}")
    tool_ms = _number(obj, "expected_tool_duration_ms", where)
    reuse = obj.get("reuse_hint")
    if reuse is not None and reuse not in ("keep", "neutral", "discard"):
        raise InvalidInput(f"{where}.reuse_hint is keep, neutral or discard, got {reuse!r}")
    return Hint(
        ttl_s=None if ttl_ms is None else ttl_ms / 1000,
        final=_flag(obj, "final", where),
        priority=None if reuse is None else PRIORITY_NAMES[reuse],
        discard=reuse == "discard",
        back_in_s=None if tool_ms is None else tool_ms / 1000,
        prefetch=bool(_flag(obj, "prefetch", where)),
        session_id=None if workflow is None else str(workflow),
    )


def retention_directives(body: Mapping[str, Any], now: float, block_tokens: int | None) -> Hint:
    """``retention_directives`` (and ``retention_scope``): the session's priority is the last
    directive's (the one reaching furthest, whose blocks go first), its soft TTL the longest
    duration; with ``block_tokens`` known, each directive's blocks keep their own priority.
    The format's order is enforced, not refused: taken by ``start``, a directive ranked above
    the one before counts as that one, one overlapping the one before starts where it ends,
    and one left with no token is dropped."""
    where = "retention_directives"
    directives = body.get(where)
    if not isinstance(directives, list) or not directives:
        raise InvalidInput(f"{where} is a non-empty list")
    scope = body.get("retention_scope")
    if scope is not None and not isinstance(scope, str):
        raise InvalidInput("retention_scope is a string")
    parsed: list[tuple[int, int | None, int, float | None]] = []
    for i, d in enumerate(directives):
        at = f"{where}[{i}]"
        if not isinstance(d, Mapping):
            raise InvalidInput(f"{at} is an object")
        start = _count(d, "start", at)
        if start is None:
            raise InvalidInput(f"{at}.start is required")
        priority = _priority(d.get("priority"), f"{at}.priority", names=False)
        if priority is None:
            raise InvalidInput(f"{at}.priority is required")
        duration = _number(d, "duration", at)
        if duration is not None and not duration > 0:
            raise InvalidInput(f"{at}.duration must be positive, got {duration}")
        parsed.append((start, _count(d, "end", at), priority, duration))
    spans: list[Span] = []
    durations: list[float] = []
    reached: int | None = 0  # where the directives before end (None: nowhere)
    last = KEEP
    for start, end, priority, duration in sorted(parsed, key=lambda d: d[0]):
        start = start if reached is None else max(start, reached)
        if reached is None or (end is not None and end <= start):
            continue  # covered by the directives before
        last = min(last, priority)
        if duration is not None:
            durations.append(duration)
        if block_tokens is not None:
            blocks_end = None if end is None else -(-end // block_tokens)
            spans.append(Span(start // block_tokens, blocks_end, last))
        reached = end
    if reached == 0:
        return Hint()  # no directive covers a token
    return Hint(ttl_s=max(durations) if durations else None, priority=last, spans=tuple(spans))


PARSERS: Mapping[str, Parser] = {
    "agent_hint": agent_hint,
    "agent_hints": sglang_agent_hints,
    "retention_directives": retention_directives,
}
"""Each format's parser, by the key its object comes under."""


# -- fields -----------------------------------------------------------------------------------


def _object(body: Mapping[str, Any], name: str, where: str | None = None) -> Mapping[str, Any]:
    obj = body.get(name)
    if not isinstance(obj, Mapping):
        raise InvalidInput(f"{where + '.' if where else ''}{name} is an object")
    return obj


def _text(obj: Mapping[str, Any], name: str, where: str, *, ids: bool = False) -> str | None:
    value = obj.get(name)
    if value is None:
        return None
    if ids and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"{where}.{name} is a non-empty string")
    return value


def _texts(obj: Mapping[str, Any], name: str, where: str) -> Sequence[str]:
    value = obj.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str | Mapping) for v in value):
        raise InvalidInput(f"{where}.{name} is a list of tool names")
    return value


def _flag(obj: Mapping[str, Any], name: str, where: str) -> bool | None:
    value = obj.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidInput(f"{where}.{name} is true or false, got {value!r}")
    return value


def _number(obj: Mapping[str, Any], name: str, where: str) -> float | None:
    value = obj.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidInput(f"{where}.{name} is a number, got {value!r}")
    if value < 0:
        raise InvalidInput(f"{where}.{name} must not be negative, got {value}")
    return float(value)


def _count(obj: Mapping[str, Any], name: str, where: str) -> int | None:
    value = obj.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput(f"{where}.{name} is a non-negative integer, got {value!r}")
    return value


def _priority(value: Any, where: str, *, names: bool = True) -> int | None:
    """A priority 0 .. 100, or (``names``) one of ``PRIORITY_NAMES``."""
    if value is None:
        return None
    if names and isinstance(value, str) and value.lower() in PRIORITY_NAMES:
        return PRIORITY_NAMES[value.lower()]
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 <= value <= 100  # False for NaN
    ):
        known = f" or one of {sorted(PRIORITY_NAMES)}" if names else ""
        raise InvalidInput(f"{where} is a number in [0, 100]{known}, got {value!r}")
    return round(value)
