"""Trace loading: Mooncake JSONL files and folders of agentic session files, as one timeline.

Both become a list of ``Request``s sorted by time, each with its chained prefix-block ids as
integers (equal ids mean a reusable prefix) and its input token count.

* Mooncake JSONL (``{"timestamp": ms, "input_length", "hash_ids", ...}`` per line, 512-token
  blocks by default): times are the trace's own; the ids are global to the file. The trace
  names no sessions, so every request is session-less (``session`` is None): the store's
  default TTL and policy apply to it. Sessions are not guessed from shared prefixes, since a
  guess would credit the policy with knowledge a real client may not give it.
* A folder of agentic session files (``*.json``, one session each, ``block_size`` tokens per
  block, usually 64): each file's start time is drawn uniformly at random over ``span_days``
  (a Poisson arrival process conditioned on the number of sessions), seeded, so the timeline
  is deterministic. A request happens at ``start + t``; a subagent's requests at
  ``start + subagent.t + child.t``. The ids of one file are local to it, so they are
  namespaced by the file's index (``(index + 1) << 40 | id``); subagents share their parent's
  id space. Each file is one session (named after the file); each subagent is a session of its
  own (``file:agent_id``), since it runs concurrently with its parent and has its own chain.
  Request types ``n`` and ``s`` are both requests; the model name is ignored (the ids already
  separate what differs). A request's ``stop`` (its finish reason) and ``api_time`` (its
  duration) are kept: a replay reveals the finish reason when the request ends, as an engine
  would pass it, never earlier (a request without ``api_time`` ends as it arrives).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sessioncache.errors import InvalidInput

DAY_S = 86400.0
MOONCAKE_BLOCK_TOKENS = 512
_FILE_SHIFT = 40


@dataclass(frozen=True, slots=True)
class Request:
    """One request of the timeline."""

    time: float
    """Seconds from the start of the replay."""
    session: str | None
    """The session it belongs to; None for session-less requests."""
    ids: tuple[int, ...]
    """Chained prefix-block ids, root first."""
    tokens: int
    """Input tokens. A hit on ``m`` blocks saves ``min(m * block_tokens, tokens)`` of them: a
    partial last block counts only its tokens, and tokens past the last id (agent traces
    give ids to full blocks only) are always computed."""
    stop: str | None = None
    """How the request finished (``tool_use``, ``end_turn``), where the trace says; a replay
    reveals it at ``time + duration`` (when the node would hear of it), never before."""
    duration: float = 0.0
    """Seconds from arrival to finish."""
    parent: str | None = None
    """The session this one was forked from (a subagent's parent)."""

    @property
    def finished(self) -> float:
        return self.time + self.duration


@dataclass(frozen=True, slots=True)
class Trace:
    """A replayable timeline (see the module docstring)."""

    name: str
    kind: str
    """``"mooncake"`` or ``"agent-sessions"``."""
    block_tokens: int
    requests: list[Request]
    unique_blocks: int
    sessions: int

    @property
    def total_tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    @property
    def total_blocks(self) -> int:
        return sum(len(r.ids) for r in self.requests)


def load_trace(
    path: str | Path,
    *,
    span_days: float = 3.0,
    seed: int = 0,
    block_tokens: int | None = None,
    half: str | None = None,
    only: Collection[str] | None = None,
) -> Trace:
    """Load a Mooncake JSONL file or a folder of agentic session files (module docstring).

    ``span_days`` and ``seed`` place the sessions of a folder; a JSONL file keeps its own
    times. ``block_tokens`` overrides the block size (JSONL: 512 unless given). ``half``
    (``even`` or ``odd``): a folder's even- or odd-numbered files only, by name; ``only``: the
    files of a folder with these names (without ``.json``: a fold of a cross-validation).
    """
    path = Path(path)
    if path.is_dir():
        return load_session_folder(path, span_days=span_days, seed=seed, half=half, only=only)
    if half is not None or only is not None:
        raise InvalidInput("--half picks files of a session folder; a JSONL trace has none")
    if not path.is_file():
        raise InvalidInput(f"no trace at {path}: give a JSONL file or a folder of sessions")
    return load_jsonl(path, block_tokens=block_tokens or MOONCAKE_BLOCK_TOKENS)


def load_jsonl(path: Path, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Trace:
    """A Mooncake-format JSONL trace (``timestamp`` in ms); every request is session-less."""
    requests: list[Request] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids = tuple(int(h) for h in row["hash_ids"])
                tokens = int(row["input_length"])
                time = float(row["timestamp"]) / 1000.0
                if not math.isfinite(time):
                    raise ValueError("a timestamp that is not a finite number")
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidInput(f"{path}:{lineno}: not a Mooncake trace row ({exc})") from exc
            requests.append(Request(time, None, ids, tokens))
    return _finish(path.name, "mooncake", block_tokens, requests, sessions=0)


HALVES = ("even", "odd")


def load_session_folder(
    path: Path,
    *,
    span_days: float = 3.0,
    seed: int = 0,
    half: str | None = None,
    only: Collection[str] | None = None,
) -> Trace:
    """A folder of agentic session files spread over ``span_days`` (module docstring); with
    ``half``, its even- or odd-numbered files only (by name, from 0); with ``only``, the files
    of these names (stems) only."""
    if span_days < 0:
        raise InvalidInput(f"span_days must be >= 0, got {span_days}")
    files = sorted(p for p in path.glob("*.json") if p.is_file())
    if half is not None:
        if half not in HALVES:
            raise InvalidInput(f"half is one of {HALVES}, got {half!r}")
        files = files[HALVES.index(half) :: 2]
    if only is not None:
        keep = set(only)
        files = [f for f in files if f.stem in keep]
    if not files:
        raise InvalidInput(f"no *.json session files in {path}")
    rng = random.Random(seed)
    span_s = span_days * DAY_S
    block_tokens: int | None = None
    requests: list[Request] = []
    sessions: set[str] = set()
    for index, file in enumerate(files):
        try:
            doc = json.loads(file.read_text())
            size = int(doc.get("block_size", 64))
            top = doc["requests"]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidInput(f"{file}: not an agentic session file ({exc})") from exc
        if block_tokens is None:
            block_tokens = size
        elif size != block_tokens:
            raise InvalidInput(f"{file}: block_size {size}, but earlier files use {block_tokens}")
        start = rng.uniform(0.0, span_s)
        base = (index + 1) << _FILE_SHIFT
        for session, parent, time, row in _walk(top, file.stem, None, start):
            try:
                ids = tuple(base | int(h) for h in row["hash_ids"])
                tokens = int(row["in"])
                stop = str(row.get("stop") or "") or None
                duration = max(0.0, float(row.get("api_time") or 0.0))
                if not (math.isfinite(time) and math.isfinite(duration)):
                    raise ValueError("a time that is not a finite number")
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidInput(f"{file}: bad request ({exc})") from exc
            sessions.add(session)
            requests.append(Request(time, session, ids, tokens, stop, duration, parent))
    assert block_tokens is not None
    return _finish(path.name, "agent-sessions", block_tokens, requests, sessions=len(sessions))


def _walk(
    rows: Sequence[Any], session: str, parent: str | None, origin: float
) -> Iterator[tuple[str, str | None, float, Any]]:
    """Every request of a session file, subagents included, with its session, that session's
    parent and its absolute time."""
    for row in rows:
        if row.get("type") == "subagent":
            name = f"{session}:{row.get('agent_id', 'agent')}"
            yield from _walk(row.get("requests", []), name, session, origin + float(row["t"]))
        elif "hash_ids" in row:
            yield session, parent, origin + float(row["t"]), row


def _finish(
    name: str, kind: str, block_tokens: int, requests: list[Request], *, sessions: int
) -> Trace:
    # A stable sort keeps file order among requests at the same instant.
    requests.sort(key=lambda r: r.time)
    return Trace(name, kind, block_tokens, requests, _count_unique(requests), sessions)


def _count_unique(requests: Iterable[Request]) -> int:
    seen: set[int] = set()
    for r in requests:
        seen.update(r.ids)
    return len(seen)
