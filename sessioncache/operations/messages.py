"""The operation layer's requests and results: plain typed values, no carrier's encoding."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from sessioncache.attribution import MissReport, SessionTotals
from sessioncache.hashing import BlockHash
from sessioncache.sessions.hints import HintState
from sessioncache.sessions.manager import Session
from sessioncache.store import Match


class LookupRequest(NamedTuple):
    """The longest held prefix of ``ids`` under ``root`` (resolved by the caller), leased for
    ``lease_s`` when given, on behalf of ``session_id`` when given."""

    root: bytes
    ids: Sequence[BlockHash]
    lease_s: float | None = None
    session_id: str | None = None
    keyed: bool = False
    """Keyed ids: each held under the root on its own, not a chain."""
    tokens: bytes | None = None
    """The prompt's tokens (``u32`` little-endian) when the node derived ``ids`` from them:
    the ids are then the caller's by construction, and attribution compares tokens."""
    counted: bool = True
    """A prompt's question (hit and miss tokens are counted); False for a probe or a fetch of
    blocks an earlier lookup counted."""
    declined: bool = False
    """The caller will load nothing (its engine cannot continue from a cached context): the
    node matches nothing, leases and touches nothing, and counts every token as missed, those
    it holds as ``declined`` (``attribution``)."""


class LookupResult(NamedTuple):
    """What a lookup matched."""

    block_tokens: int
    hashes: list[BlockHash]
    """Every id asked."""
    match: Match
    key: bytes | None
    """The caller's key for the match's lease (None: no lease)."""
    nbytes: int
    """The payload size of the matched blocks (one per namespace root; 0 when none)."""
    miss: MissReport | None = None
    """Why the tokens past the match missed (None for an uncounted lookup)."""


class StoreRequest(NamedTuple):
    """A chain segment (or a batch of keyed blocks) to store under ``root``: its ids are
    derived from ``parent`` (or the root) and ``units`` (tokens, or 16-byte keys when
    ``keyed``)."""

    root: bytes
    parent: bytes | None
    block_tokens: int
    blocks: int
    block_nbytes: int
    units: bytes
    ttl_s: float | None = None
    keyed: bool = False
    linked: bool = True
    """Keyed blocks: block ``i`` hangs off block ``i - 1`` (a chain segment always does)."""
    session_id: str | None = None
    durable: bool = False
    """Answer once every block is on the durable tier (else: write-behind)."""
    finish_reason: str | None = None
    """With ``session_id``: the request whose KV this is has finished, for this reason
    (``forecast.FINISH_CLASSES``); the session's chain is filed under what follows."""


class SessionOpen(NamedTuple):
    """Open a session of the caller's tenant (or return its open one of ``session_id``):
    ``kind`` names its default TTL, ``ttl_s`` overrides it, ``parent`` is the caller's session
    it was forked from (a subagent's)."""

    session_id: str | None = None
    kind: str = "agent"
    ttl_s: float | None = None
    parent: str | None = None


class SessionExtend(NamedTuple):
    """Slide a session's expiry, with a new TTL when ``ttl_s`` is given."""

    session_id: str
    ttl_s: float | None = None


class SessionFinish(NamedTuple):
    """A session's latest request finished, for ``finish_reason`` (``forecast.FINISH_CLASSES``)."""

    session_id: str
    finish_reason: str


class SessionHint(NamedTuple):
    """An agent hint for a session, in any of the field's formats (``sessions.hints``: the
    body holds ``agent_hint``, ``agent_hints`` or ``retention_directives``); ``block_tokens``:
    the engine's tokens per block, which maps token positions onto blocks."""

    session_id: str
    body: Mapping[str, Any]
    block_tokens: int | None = None


class PrefetchResult(NamedTuple):
    """What became of a prefetch request: ``outcome`` is ``accepted`` (the chain is being
    moved into the first tier), ``deferred`` or ``rejected``, ``reason`` says why, ``blocks``
    how many blocks it moves."""

    outcome: str
    reason: str
    blocks: int


class SessionResult(NamedTuple):
    """A session as an operation answers it."""

    session: Session
    expected_back: float | None
    """When the session is predicted back (its forecast); None before its first request here."""
    last_finish: str | None
    """The class of its latest request's finish, once told."""
    totals: SessionTotals | None = None
    """Its lookups' tokens hit and missed by reason (a ``get`` only)."""
    hint: HintState | None = None
    """Its agent hints as they stand (None: none)."""
    resident: Mapping[str, int] | None = None
    """Blocks of its chain per tier (a ``get`` only, where the node can tell)."""
    prefetch: PrefetchResult | None = None
    """The prefetch a hint asked for (a ``hint`` only)."""
