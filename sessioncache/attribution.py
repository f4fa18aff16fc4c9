"""Miss attribution: why the tokens of a lookup that the cache could not serve missed.

Every block a lookup misses gets one reason (``docs/prompt-stability.md``):

* ``diverged``: the session's previous prompt had other content at this position: the prompt
  differs from it at block ``k`` (and token ``offset`` inside that block), so the blocks from
  ``k`` to the end of the previous prompt were cached but are unusable;
* ``evicted``: the block was held and left the cache for room, from tier ``tier``, ``ago_s``
  seconds ago, under ``capacity`` pressure or because the session's pins were dropped by the
  ``pin_budget``;
* ``expired``: the block's TTL ran out ``ago_s`` seconds ago;
* ``new``: never held (the conversation grew, the normal case), and the tokens past the last
  full block, which no block holds;
* ``declined``: held, but the caller said it would load nothing (an engine that cannot
  continue from a cached context: it asked the node but loads nothing). Its lookup counts
  the blocks the node holds for it as ``declined`` and the rest by the reasons above.

What it costs, and why it stays bounded:

* ``DropLog`` (a ``StoreObserver``) keeps, per tier, a ring of the last ``ring_blocks`` ids
  whose last copy left the store from that tier, with when and whether their TTL had run out:
  not a second index, only what fell out recently. An id older than the ring is reported as
  ``evicted`` with no tier when the session is known to have held it, else as ``new``.
* ``Attribution`` keeps per session (at most ``max_sessions``, least recently active dropped
  first) its previous prompt: the last one it stored (``POST /v1/store`` naming the session),
  or the matched part of a lookup whose held chain that prompt does not cover (a session
  stored through other means). A lookup that diverges does not replace it, so that a retry,
  or a second engine, is told the same. It is kept compactly: its ids as one ``bytes``
  (16 bytes a block, for the divergence block by binary search: ids commit to their whole
  prefix, so "same id at position i" is true up to the divergence and false after) and a
  reference to the prompt's token bytes (the request's own buffer, no copy; for the token
  offset inside the diverging block), plus the totals ``GET /v1/sessions/{id}`` reports.

Thread-safe: one lock each; the store calls ``DropLog`` with its own lock held (lock order
store, then drop log) and ``Attribution`` never calls the store holding its lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, NamedTuple

from sessioncache.hashing import HASH_BYTES, BlockHash, divergence_block
from sessioncache.sessions.manager import SessionKey
from sessioncache.store.blocks import BlockMeta
from sessioncache.store.events import Touched

Reason = Literal["diverged", "evicted", "expired", "new", "declined"]
REASONS: tuple[Reason, ...] = ("diverged", "evicted", "expired", "new", "declined")
Pressure = Literal["capacity", "pin_budget"]

DEFAULT_RING_BLOCKS = 65_536
DEFAULT_MAX_SESSIONS = 10_000


class Drop(NamedTuple):
    """A block whose last copy left the store."""

    tier: str
    """The tier its last copy left."""
    at: float
    expires_at: float
    expired: bool
    """Its TTL had run out when it left (the sweep, or an expired victim)."""
    namespace_root: bytes


class DropLog:
    """Per tier, a ring of the ids whose last copy recently left the store from that tier
    (a ``StoreObserver``, fed by ``TieredStore._drop_from_tier``)."""

    def __init__(self, ring_blocks: int = DEFAULT_RING_BLOCKS) -> None:
        if ring_blocks < 1:
            raise ValueError("ring_blocks must be at least 1")
        self._size = ring_blocks
        self._rings: dict[str, OrderedDict[BlockHash, Drop]] = {}
        self._lock = threading.Lock()

    # StoreObserver: only the last copy's departure matters here
    def block_added(self, meta: BlockMeta, tier: str, durable: bool) -> None:
        pass

    def block_removed(self, block_hash: BlockHash, tier: str, durable: bool) -> None:
        pass

    def blocks_touched(self, touched: Touched) -> None:
        pass

    def block_dropped(self, meta: BlockMeta, tier: str, now: float) -> None:
        """``meta``'s last copy left ``tier`` (evicted, expired or deleted)."""
        drop = Drop(tier, now, meta.expires_at, meta.expired(now), meta.namespace_root)
        with self._lock:
            ring = self._rings.get(tier)
            if ring is None:
                ring = self._rings[tier] = OrderedDict()
            ring[meta.block_hash] = drop
            ring.move_to_end(meta.block_hash)
            if len(ring) > self._size:
                ring.popitem(last=False)

    def find(self, block_hash: BlockHash) -> Drop | None:
        """The latest drop of ``block_hash`` still remembered."""
        with self._lock:
            found = None
            for ring in self._rings.values():
                drop = ring.get(block_hash)
                if drop is not None and (found is None or drop.at > found.at):
                    found = drop
            return found

    def find_many(self, hashes: Sequence[BlockHash]) -> list[Drop | None]:
        """``find`` for each id, under one hold of the lock."""
        with self._lock:
            rings = [r for r in self._rings.values() if r]
            if not rings:
                return [None] * len(hashes)
            if len(rings) == 1:
                return [rings[0].get(h) for h in hashes]
            out: list[Drop | None] = []
            for h in hashes:
                found = None
                for ring in rings:
                    drop = ring.get(h)
                    if drop is not None and (found is None or drop.at > found.at):
                        found = drop
                out.append(found)
            return out

    def size(self) -> dict[str, int]:
        with self._lock:
            return {tier: len(ring) for tier, ring in self._rings.items()}


@dataclass(frozen=True, slots=True)
class MissCause:
    """Why one block missed: the first missed block of a lookup (``explain``)."""

    reason: Reason
    block: int
    """Index of the block in the prompt."""
    token: int
    """Index of the block's first token in the prompt (for ``diverged``: of the first token
    that differs, when the previous prompt's tokens are known)."""
    offset: int | None = None
    """``diverged``: the first differing token's position inside the block (None when the
    lookup came as ids, without tokens)."""
    tier: str | None = None
    """``evicted`` (and ``expired``): the tier the block's last copy left."""
    ago_s: float | None = None
    """``evicted``: since it left; ``expired``: since its TTL ran out."""
    pressure: Pressure | None = None
    """``evicted``: ``capacity``, or ``pin_budget`` when the session's pins had been dropped
    by the pin budget."""


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where a prompt first differed from its session's previous prompt."""

    block: int
    offset: int | None
    token: int
    at: float
    lost_blocks: int
    """Blocks of the previous prompt from ``block`` on: cached, unusable for this prompt."""


class MissReport(NamedTuple):
    """The attribution of one lookup's missed tokens."""

    first: MissCause | None
    tokens: dict[Reason, int]
    """Missed tokens by reason; they add up to the lookup's missed tokens."""
    divergence: Divergence | None


@dataclass(slots=True)
class SessionTotals:
    """A session's lookups: tokens hit and missed by reason, its last divergence."""

    lookups: int = 0
    hit_tokens: int = 0
    miss_tokens: dict[Reason, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    last_divergence: Divergence | None = None


class Lookup(NamedTuple):
    """A lookup as attribution sees it: what it asked for and how much of it was found."""

    root: bytes
    hashes: Sequence[BlockHash]
    matched: int
    """Blocks of ``hashes`` found, from the first."""
    block_tokens: int
    asked_tokens: int
    """The tokens asked for: the full blocks' and any past the last full block."""
    tokens: bytes | None = None
    """The prompt's token bytes, when it came as tokens."""


@dataclass(frozen=True, slots=True)
class PreviousPrompt:
    """A session's previous prompt (module docstring), what ``classify`` compares with."""

    ids: bytes = b""
    """Its block ids, concatenated."""
    tokens: bytes | None = None
    held: int = 0
    """How many of its blocks the store held (or was handed to store)."""
    budget_unpinned: bool = False
    """Whether the pin budget has dropped the session's pins since."""


@dataclass(slots=True)
class _Trail:
    prev: PreviousPrompt = PreviousPrompt()
    totals: SessionTotals = field(default_factory=SessionTotals)


class StoreView(NamedTuple):
    """What attribution reads of the store: ``TieredStore.reads.meta``, ``where`` (cheaper: no
    snapshot) and its clock's ``now``."""

    meta: Callable[[BlockHash], BlockMeta | None]
    where: Callable[[BlockHash], list[str]]
    now: Callable[[], float]


class Attribution:
    """Classifies lookups' misses and keeps the per-session and node-wide totals."""

    def __init__(
        self,
        store: StoreView,
        drops: DropLog,
        *,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        self._store = store
        self.drops = drops
        self._max_sessions = max_sessions
        self._trails: OrderedDict[SessionKey, _Trail] = OrderedDict()
        self._miss_tokens: dict[Reason, int] = dict.fromkeys(REASONS, 0)
        self._lock = threading.Lock()

    # -- per lookup ------------------------------------------------------------------------

    def lookup(
        self, lookup: Lookup, *, session: SessionKey | None = None, declined: bool = False
    ) -> MissReport:
        """Classify a lookup's missed tokens (``hashes[matched:]`` and the tokens past the last
        full block), add them to the totals and, for a ``session`` (tenant, id), remember the
        prompt as the session's previous one. ``declined``: the caller loads nothing, so the
        ``matched`` blocks (held) miss too, as ``declined``, and nothing hits."""
        trail = None
        prev = PreviousPrompt()
        if session is not None:
            with self._lock:
                trail = self._trail(session)
                prev = trail.prev
        report = classify(self._store, self.drops, lookup, prev)
        _, hashes, matched, block_tokens, _, tokens = lookup
        hit_tokens = matched * block_tokens
        if declined:
            report = _declined(report, hit_tokens)
            hit_tokens = 0
        with self._lock:
            for reason, count in report.tokens.items():
                self._miss_tokens[reason] += count
            if trail is not None:
                totals = trail.totals
                totals.lookups += 1
                totals.hit_tokens += hit_tokens
                for reason, count in report.tokens.items():
                    totals.miss_tokens[reason] += count
                div, last = report.divergence, totals.last_divergence
                # the same divergence told by ids alone (another engine's lookup) keeps the
                # offset a lookup by tokens found
                if div is not None and not (
                    div.offset is None and last is not None and last.block == div.block
                ):
                    totals.last_divergence = div
                prev = trail.prev
                prev_n = len(prev.ids) // HASH_BYTES
                if matched and (
                    matched > prev_n
                    or not _continues(prev.ids, hashes[matched - 1], matched)
                    or (matched == prev_n and tokens is not None and prev.tokens is None)
                ):
                    # a held chain the reference does not cover: it becomes the reference
                    # (keeping the tokens of one it only extends, when this came as ids)
                    ids = b"".join(hashes[:matched])
                    extends = prev_n and _continues(ids, BlockHash(prev.ids[-HASH_BYTES:]), prev_n)
                    if tokens is None and extends:
                        tokens = prev.tokens
                    trail.prev = replace(prev, ids=ids, tokens=tokens, held=matched)
        return report

    def each(
        self, root: bytes, missed: Sequence[BlockHash], block_tokens: int
    ) -> dict[Reason, int]:
        """Classify ids asked each on its own (an EXISTS of keyed blocks) that missed: a
        block remembered as dropped under ``root`` is ``evicted`` or ``expired``, any other is
        ``new``; added to the node-wide totals."""
        counts: dict[Reason, int] = dict.fromkeys(REASONS, 0)
        for drop in self.drops.find_many(missed):
            if drop is not None and drop.namespace_root == root:
                counts["expired" if drop.expired else "evicted"] += block_tokens
            else:
                counts["new"] += block_tokens
        with self._lock:
            for reason, count in counts.items():
                self._miss_tokens[reason] += count
        return counts

    def stored(
        self,
        session: SessionKey,
        hashes: Sequence[BlockHash],
        tokens: bytes | None,
    ) -> None:
        """The session stored this prompt: it is now the session's previous prompt, held."""
        ids = b"".join(hashes)
        with self._lock:
            trail = self._trail(session)
            trail.prev = PreviousPrompt(ids, tokens, len(hashes))

    # -- session events --------------------------------------------------------------------

    def unpinned(self, session: SessionKey, cause: str) -> None:
        """The session's pins were dropped (``pin_budget``, ``idle``) or it ended
        (``closed``, ``expired``: its totals go with it)."""
        with self._lock:
            if cause in ("closed", "expired"):
                self._trails.pop(session, None)
                return
            trail = self._trails.get(session)
            if trail is not None:
                trail.prev = replace(trail.prev, budget_unpinned=cause == "pin_budget")

    def session_totals(self, session: SessionKey) -> SessionTotals:
        """The totals of a session (zeros when nothing is known of it)."""
        with self._lock:
            trail = self._trails.get(session)
            if trail is None:
                return SessionTotals()
            t = trail.totals
            return SessionTotals(t.lookups, t.hit_tokens, dict(t.miss_tokens), t.last_divergence)

    def miss_tokens(self) -> dict[Reason, int]:
        """Node-wide missed tokens by reason (``/metrics``)."""
        with self._lock:
            return dict(self._miss_tokens)

    def _trail(self, session: SessionKey) -> _Trail:
        trail = self._trails.get(session)
        if trail is None:
            trail = self._trails[session] = _Trail()
            if len(self._trails) > self._max_sessions:
                self._trails.popitem(last=False)
        else:
            self._trails.move_to_end(session)
        return trail


def _declined(report: MissReport, held_tokens: int) -> MissReport:
    """``report`` of a lookup whose caller loads nothing: the ``held_tokens`` it matched miss
    as ``declined``, the first of them first."""
    if not held_tokens:
        return report
    tokens = dict(report.tokens)
    tokens["declined"] += held_tokens
    return MissReport(MissCause("declined", 0, 0), tokens, report.divergence)


def _continues(prev_ids: bytes, last: BlockHash, n: int) -> bool:
    """Whether a chain of ``n`` blocks ending in ``last`` is a prefix of ``prev_ids``."""
    return prev_ids[(n - 1) * HASH_BYTES : n * HASH_BYTES] == last


def first_token_difference(a: bytes, b: bytes, start: int, end: int) -> int | None:
    """The first token index in ``[start, end)`` where little-endian uint32 token strings
    ``a`` and ``b`` differ (None if they agree there)."""
    for i in range(start, end):
        if a[4 * i : 4 * i + 4] != b[4 * i : 4 * i + 4]:
            return i
    return None


def classify(
    store: StoreView, drops: DropLog, lookup: Lookup, prev: PreviousPrompt = PreviousPrompt()
) -> MissReport:
    """The reason of every missed block (module docstring), in order of precedence: past
    the divergence point and within the previous prompt: ``diverged``; remembered as dropped
    (under the caller's namespace root only, so one tenant learns nothing of another's ids):
    ``evicted`` or ``expired``; held but expired: ``expired``; held (behind a hole): the
    reason of the hole; part of the previous prompt the session held: ``evicted`` beyond the
    rings' memory; else ``new``."""
    root, hashes, matched, block_tokens, asked_tokens, tokens = lookup
    prev_ids, prev_tokens, budget_unpinned = prev.ids, prev.tokens, prev.budget_unpinned
    n = len(hashes)
    counts: dict[Reason, int] = dict.fromkeys(REASONS, 0)
    counts["new"] = max(0, asked_tokens - n * block_tokens)  # past the last full block
    prev_n = len(prev_ids) // HASH_BYTES
    k = divergence_block(hashes, prev_ids) if prev_n else None
    divergence = None
    if k is not None:
        offset = None
        token = k * block_tokens
        if tokens is not None and prev_tokens is not None:
            end = min(len(tokens) // 4, len(prev_tokens) // 4, token + block_tokens)
            diff = first_token_difference(tokens, prev_tokens, token, end)
            if diff is not None:
                offset, token = diff - token, diff
        divergence = Divergence(k, offset, token, store.now(), prev_n - k)
    if matched >= n:
        return MissReport(None, counts, divergence)

    # [d0, d1): missed blocks past the divergence, within the previous prompt: diverged
    div_start = k if k is not None else n
    d0, d1 = max(matched, div_start), (min(prev_n, n) if k is not None else 0)
    held_lim = min(prev_n, prev.held, div_start)  # the previous prompt's blocks before k
    now = store.now()
    # Held blocks among the missed are rare (an expired chain not yet swept, a hole): read
    # records one by one only when the first missed block is one
    probe = bool(store.where(hashes[matched]))

    def cause_of(i: int, drop: Drop | None, hole: Reason | None) -> MissCause:
        if d0 <= i < d1:
            assert divergence is not None
            if i == k:
                return MissCause("diverged", i, divergence.token, divergence.offset)
            return MissCause("diverged", i, i * block_tokens)
        if drop is not None and drop.namespace_root == root:
            if drop.expired:
                return MissCause(
                    "expired", i, i * block_tokens, tier=drop.tier, ago_s=now - drop.expires_at
                )
            pressure: Pressure = "pin_budget" if budget_unpinned and i < held_lim else "capacity"
            return MissCause(
                "evicted",
                i,
                i * block_tokens,
                tier=drop.tier,
                ago_s=now - drop.at,
                pressure=pressure,
            )
        meta = store.meta(hashes[i]) if probe else None
        if meta is not None and meta.namespace_root == root:
            if meta.expired(now):
                return MissCause("expired", i, i * block_tokens, ago_s=now - meta.expires_at)
            return MissCause(hole or "new", i, i * block_tokens)  # held, behind the hole
        if i < held_lim:
            return MissCause("evicted", i, i * block_tokens)  # older than the rings
        return MissCause("new", i, i * block_tokens)

    first = cause_of(matched, drops.find(hashes[matched]), None)
    counts[first.reason] += block_tokens
    rest = matched + 1
    segments = [(rest, n)]
    if d1 > d0:
        counts["diverged"] += max(0, d1 - max(d0, rest)) * block_tokens
        segments = [(rest, d0), (max(d1, rest), n)]
    # The rest, outside the diverged span, in bulk unless the first block of the run is
    # remembered or held: chains leave tail first (a block's children before it), so when the
    # first block of a run is not remembered, neither are the blocks after it
    for a, b in segments:
        if a >= b:
            continue
        known = first.reason in ("evicted", "expired") if a == rest else drops.find(hashes[a])
        if not probe and not known:
            evicted = max(0, min(b, held_lim) - a)
            counts["evicted"] += evicted * block_tokens
            counts["new"] += (b - a - evicted) * block_tokens
            continue
        for i, drop in enumerate(drops.find_many(hashes[a:b]), a):
            counts[cause_of(i, drop, first.reason).reason] += block_tokens
    return MissReport(first, counts, divergence)
