"""Prompt tokens found in the cache (hit) or not (miss): per node, per namespace root and per
session, for ``/metrics``, the dashboard and the durable usage history.

Counted by the operation layer (``sessioncache.operations``) for every lookup, whatever carried
it. Keyed blocks carry no tokens: each counts as its namespace's ``block_tokens``."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

from sessioncache.sessions.manager import SessionKey
from sessioncache.store.events import UsageRecorder

MAX_TRACKED = 100_000
"""Most namespaces and sessions whose token counts are kept in memory."""


@dataclass(slots=True)
class TokenCounts:
    hit: int = 0
    miss: int = 0


class TokenAccounting:
    """Hit and miss tokens since the process started (module docstring)."""

    def __init__(self, usage: UsageRecorder | None = None) -> None:
        self._lock = threading.Lock()
        self._tokens = TokenCounts()
        # per namespace root and per session (bounded: a flood starts them afresh)
        self._root_tokens: dict[bytes, TokenCounts] = {}
        self._session_hits: dict[SessionKey, int] = {}
        self.usage = usage

    def count(
        self, hit: int, asked: int, *, root: bytes, session: SessionKey | None = None
    ) -> None:
        """One lookup of ``asked`` tokens under ``root``, ``hit`` of them held."""
        with self._lock:
            self._tokens.hit += hit
            self._tokens.miss += asked - hit
            per_root = self._root_tokens.get(root)
            if per_root is None:
                if len(self._root_tokens) >= MAX_TRACKED:
                    self._root_tokens.clear()
                per_root = self._root_tokens[root] = TokenCounts()
            per_root.hit += hit
            per_root.miss += asked - hit
            if session is not None and hit:
                if session not in self._session_hits and len(self._session_hits) >= MAX_TRACKED:
                    self._session_hits.clear()
                self._session_hits[session] = self._session_hits.get(session, 0) + hit
        if self.usage is not None:  # durable history, bucketed (write-behind, never blocks)
            self.usage.record_usage("hit_tokens", hit)
            self.usage.record_usage("miss_tokens", asked - hit)

    def totals(self) -> TokenCounts:
        with self._lock:
            return replace(self._tokens)

    def per_namespace(self) -> dict[bytes, TokenCounts]:
        with self._lock:
            return {root: replace(t) for root, t in self._root_tokens.items()}

    def session_hits(self, sessions: Sequence[SessionKey]) -> dict[SessionKey, int]:
        with self._lock:
            return {key: self._session_hits.get(key, 0) for key in sessions}
