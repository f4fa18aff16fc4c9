"""The caches a replay compares, all behind one small interface (``Simulator``).

* ``OracleSim``: an infinite cache; a block misses only the first time it is seen.
* ``LruSim``: a plain LRU over blocks, independent of the production code: no chain awareness,
  no pins, optionally a sliding TTL (``ttl_5min`` is this with ``ttl_s=300``). Its tiers form
  one exclusive LRU stack: new and hit blocks enter the first tier, the first tier's least
  recently used block moves down to the next, the last tier's is dropped; a hit in a lower
  tier moves the block back up (the usual promote-on-hit). By default a request touches its
  blocks in prompt order, root first, so the root is the least recent block of its chain: the
  textbook LRU, which can evict a prefix from under its own tail. ``tail_first=True`` touches
  the deepest block first (what engines such as vLLM do), a stronger baseline.
* ``BeladySim``: clairvoyant (Belady's MIN over blocks, with bypass): it knows every future
  request and evicts the block reused furthest in the future, deepest first among ties. Not a
  policy anyone can run; an estimate of the best any policy could do at that capacity. It
  ignores the tier split (one pool of the total capacity).
* ``StoreSim``: the production ``TieredStore`` (its ``EvictionPolicy`` unless another is given)
  and, for requests that name a session, the production ``SessionManager``, over
  ``AccountingTier``s and a ``ManualClock``. It follows the service's data path: a lookup in
  the session leasing its match, a ``get`` of every matched block held only below the first
  tier (the engine's load, which promotes it), the lease's release, then a store of the missing
  blocks, parent = the last matched block: in a session through the operation layer, as a
  STORE naming it (``operations.stores``: plan, blocks, completion), else a plain put. A trace
  block is stored as four tokens of its integer id, so the store's ids are the ones the node
  derives (``hashing``), chained as the trace's are. ``sweep`` runs every ``sweep_s``
  simulated seconds, as the service's background thread does (a sweep between two requests is
  run at the last sweep instant before the second one: nothing happens in between, so the
  state is the same). A request's finish reason reaches it through ``finish`` when the request
  ends (``Finishes``), as a connector passes it, and a subagent's session is opened with its
  parent's. With ``prefetch`` (``PREFETCH_MODES``) the node's prefetch engine
  (``sessions.prefetch``) runs too: its forecast pass ticks every ``PREFETCH_TICK_S``
  between two events and at the last one-second tick before each request or finish, and its
  moves run there; ``oracle`` runs the same engine with each session's true
  next arrival instead of its forecast (a move is due at the tick before it). ``none`` ticks
  nothing (the engine is there, unused). With ``hints="oracle"`` every session tells the
  node, as an agent's hint would (``SessionManager.hint``), when it is next back: at each
  arrival and each finish, its true next arrival (``back_in_s``), or that it is done
  (``final``) after its last request: what the node's eviction makes of exact return dates
  (``HINT_MODES``).

Every ``serve`` returns, for each matched block of the request's prefix, the index of the
fastest tier that held it.
"""

from __future__ import annotations

import bisect
import contextlib
import heapq
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any, Final, Protocol

from sessioncache.attribution import DropLog
from sessioncache.clock import ManualClock
from sessioncache.config import Settings
from sessioncache.errors import SessionCacheError, SessionNotFound
from sessioncache.hashing import BlockHash, Namespace, block_hashes_from_bytes
from sessioncache.node import OPEN_TENANT, CacheNode, make_prefetcher
from sessioncache.operations import lookups, stores
from sessioncache.operations.caller import Caller
from sessioncache.operations.messages import StoreRequest
from sessioncache.replay.trace import Request, Trace
from sessioncache.sessions.hints import Hint
from sessioncache.sessions.manager import SessionKey, SessionManager
from sessioncache.sessions.prefetch import TICK_S, Prefetcher
from sessioncache.status import BlockStatus, kept
from sessioncache.store import DEFAULT_TTL_S, TieredStore
from sessioncache.store.eviction import EvictionPolicy
from sessioncache.store.forecast import MIN_GAP_S
from sessioncache.tiers.accounting import AccountingTier, zero_payload

NAMESPACE = Namespace("sessioncache-replay", 4, "float16", "replay")
"""The one namespace of a replay (trace ids are already distinct per session file): a trace
block is four tokens, the 16 bytes of its integer id."""

CLOCK_START = 1_700_000_000.0

PREFETCH_MODES = ("none", "forecast", "oracle")
"""What moves chains up ahead of their reads in a replay (``StoreSim``'s ``prefetch``)."""

HINT_MODES = ("none", "oracle")
"""What the sessions of a replay tell the node of their return (``StoreSim``'s ``hints``)."""

PREFETCH_TICK_S = 10.0
"""The replay's forecast prefetch pass runs every this many simulated seconds between two
events, and at the last one-second tick before each (the node's runs every second: a
coarser grid between events, where only the clock moves, keeps a 3-day replay short)."""

LOAD_LEASE_S = 30.0
"""The lease an engine takes on its lookup's match while it loads it (docs/architecture.md)."""


class Simulator(Protocol):
    """One cache under replay."""

    @property
    def name(self) -> str: ...

    @property
    def tier_names(self) -> list[str]: ...

    def serve(self, request: Request) -> list[int]:
        """Serve ``request``: return the tier index of each block of its matched prefix."""
        ...

    def detail(self) -> dict[str, Any]:
        """Counters worth reporting after the run."""
        ...

    def close(self) -> None: ...


class Finishes(Protocol):
    """A simulator that hears when a request finishes, and how (its ``stop``)."""

    def finish(self, request: Request) -> None: ...


class Explains(Protocol):
    """A simulator that can tell, right after ``serve``, why a block of the request that it
    had held before missed (miss attribution): ``expired`` or ``evicted``."""

    def why_missing(self, block: int) -> str: ...


class OracleSim:
    """An infinite cache: the best any policy can do."""

    def __init__(self, name: str = "oracle") -> None:
        self.name: Final = name
        self._seen: set[int] = set()

    @property
    def tier_names(self) -> list[str]:
        return ["infinite"]

    def serve(self, request: Request) -> list[int]:
        seen = self._seen
        matched = 0
        for block in request.ids:
            if block not in seen:
                break
            matched += 1
        seen.update(request.ids)
        return [0] * matched

    def detail(self) -> dict[str, Any]:
        return {"blocks_held": len(self._seen)}

    def close(self) -> None:
        self._seen.clear()


class LruSim:
    """A plain LRU over blocks, optionally with a sliding TTL (see the module docstring)."""

    def __init__(
        self,
        name: str,
        tiers: Sequence[tuple[str, int]],
        *,
        ttl_s: float | None = None,
        tail_first: bool = False,
    ) -> None:
        if not tiers:
            raise ValueError("an LRU needs at least one tier")
        self.name: Final = name
        self._tier_names = [t for t, _ in tiers]
        self._caps = [c for _, c in tiers]
        self._ttl = ttl_s
        self._tail_first = tail_first
        # Per tier: block -> last access time, least recent first.
        self._tiers: list[OrderedDict[int, float]] = [OrderedDict() for _ in tiers]
        self._evictions = 0
        self._expired_hits = 0
        self._expired_now: set[int] = set()

    @property
    def tier_names(self) -> list[str]:
        return list(self._tier_names)

    def serve(self, request: Request) -> list[int]:
        now, ttl, tiers = request.time, self._ttl, self._tiers
        matched: list[int] = []
        for block in request.ids:
            index, last = 0, None
            for tier in tiers:
                last = tier.get(block)
                if last is not None:
                    break
                index += 1
            if last is None:
                break
            if ttl is not None and last + ttl <= now:
                self._expired_hits += 1
                break
            matched.append(index)
        if ttl is not None:  # held past their TTL: what made this request miss them
            self._expired_now = {
                b
                for b in request.ids[len(matched) :]
                if any((last := t.get(b)) is not None and last + ttl <= now for t in tiers)
            }
        for block in reversed(request.ids) if self._tail_first else request.ids:
            self._touch(block, now)
        return matched

    def why_missing(self, block: int) -> str:
        return "expired" if block in self._expired_now else "evicted"

    def _touch(self, block: int, now: float) -> None:
        top = self._tiers[0]
        if block in top:
            top.move_to_end(block)
            top[block] = now
            return
        for tier in self._tiers[1:]:
            if tier.pop(block, None) is not None:
                break
        top[block] = now
        self._cascade()

    def _cascade(self) -> None:
        tiers, caps = self._tiers, self._caps
        last = len(tiers) - 1
        for index in range(last + 1):
            tier = tiers[index]
            while len(tier) > caps[index]:
                block, when = tier.popitem(last=False)
                if index < last:
                    tiers[index + 1][block] = when
                else:
                    self._evictions += 1

    def detail(self) -> dict[str, Any]:
        return {
            "evictions": self._evictions,
            "expired_lookups": self._expired_hits,
            "blocks_held": sum(len(t) for t in self._tiers),
        }

    def close(self) -> None:
        for tier in self._tiers:
            tier.clear()


class BeladySim:
    """Clairvoyant eviction over ``trace`` (see the module docstring); serve its requests in
    order, each exactly once."""

    _NEVER = 1 << 62

    def __init__(self, trace: Trace, capacity_blocks: int, name: str = "belady") -> None:
        self.name: Final = name
        self._capacity = capacity_blocks
        # For request i and each of its blocks, the index of the next request using the block.
        never = self._NEVER
        upcoming: dict[int, int] = {}
        self._next: list[list[int]] = [[] for _ in trace.requests]
        for i in range(len(trace.requests) - 1, -1, -1):
            ids = trace.requests[i].ids
            self._next[i] = [upcoming.get(b, never) for b in ids]
            for b in ids:
                upcoming[b] = i
        self._served = 0
        self._held: dict[int, tuple[int, int]] = {}  # block -> (next use, depth)
        self._heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block), lazy

    @property
    def tier_names(self) -> list[str]:
        return ["all"]

    def serve(self, request: Request) -> list[int]:
        held, heap, never = self._held, self._heap, self._NEVER
        matched = 0
        for block in request.ids:
            if block not in held:
                break
            matched += 1
        for depth, (block, use) in enumerate(
            zip(request.ids, self._next[self._served], strict=True)
        ):
            key = (use, depth)
            if block not in held:
                if use == never:
                    continue
                if len(held) >= self._capacity:
                    while heap and held.get(heap[0][2]) != (-heap[0][0], -heap[0][1]):
                        heapq.heappop(heap)
                    if not heap or (-heap[0][0], -heap[0][1]) <= key:
                        continue  # every held block is reused sooner: bypass this one
                    del held[heapq.heappop(heap)[2]]
            held[block] = key
            heapq.heappush(heap, (-use, -depth, block))
        self._served += 1
        return [0] * matched

    def detail(self) -> dict[str, Any]:
        return {"blocks_held": len(self._held)}

    def close(self) -> None:
        self._held.clear()
        self._heap.clear()


class StoreSim:
    """The production store and sessions over accounting tiers (see the module docstring)."""

    def __init__(
        self,
        name: str,
        tiers: Sequence[tuple[str, int]],
        *,
        block_bytes: int,
        policy: EvictionPolicy | None = None,
        default_ttl_s: float = DEFAULT_TTL_S,
        sessions: bool = True,
        session_kind: str = "agent",
        session_options: Mapping[str, Any] | None = None,
        sweep_s: float = 60.0,
        prefetch: str | None = None,
        trace: Trace | None = None,
        hints: str = "none",
    ) -> None:
        """``prefetch``: one of ``PREFETCH_MODES`` (None: as ``none``); ``hints``: one of
        ``HINT_MODES``; either's ``oracle`` needs the ``trace`` it replays, whose arrivals it
        knows."""
        if prefetch is not None and prefetch not in PREFETCH_MODES:
            raise ValueError(f"prefetch is one of {PREFETCH_MODES}, got {prefetch!r}")
        if hints not in HINT_MODES:
            raise ValueError(f"hints is one of {HINT_MODES}, got {hints!r}")
        if (prefetch == "oracle" or hints == "oracle") and trace is None:
            raise ValueError("an oracle needs the trace")
        if hints == "oracle" and not sessions:
            raise ValueError("hints need sessions")
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        if not sweep_s > 0:
            raise ValueError(f"sweep_s must be positive, got {sweep_s}")
        self.name: Final = name
        self._tier_names = [t for t, _ in tiers]
        self._tier_index = {t: i for i, t in enumerate(self._tier_names)}
        self.clock = ManualClock(CLOCK_START)
        self.store = TieredStore(
            [AccountingTier(t, c) for t, c in tiers],
            policy,
            clock=self.clock,
            default_ttl_s=default_ttl_s,
        )
        self.sessions = SessionManager(self.store, **(session_options or {})) if sessions else None
        # The node of the operation layer over them; a session's stores go through it.
        self.node: CacheNode | None = None
        self.prefetch: Prefetcher | None = None
        self._arrivals: dict[str, list[float]] = (
            _arrivals(trace) if trace is not None and "oracle" in (prefetch, hints) else {}
        )
        self._hints = hints == "oracle"
        if self.sessions is not None:
            settings = Settings(prefetch_forecast=prefetch in ("forecast", "oracle"))
            self.node = CacheNode(settings, self.store, self.sessions)
            if prefetch == "oracle":
                self.node.prefetch = make_prefetcher(
                    settings, self.store, self.sessions, self.node.pins, returns=self._returns
                )
            if prefetch in ("forecast", "oracle"):
                self.prefetch = self.node.prefetch
        self._caller = Caller(OPEN_TENANT)
        self._root = (
            lookups.resolve(self.node, self._caller, NAMESPACE) if self.node else NAMESPACE.root()
        )
        self._seed = self.node.settings.hash_seed if self.node else 0
        self._kind = session_kind
        self._block_bytes = block_bytes
        self._payload = zero_payload(block_bytes)
        self._ids: dict[int, BlockHash] = {}
        self._sweep_s = sweep_s
        self._next_sweep = sweep_s
        self._sweeps = 0
        self._dropped = 0
        self._session_reopens = 0
        self._opened: set[str] = set()
        # Miss attribution as the service does it: the ring of ids whose last copy left
        self.drops = DropLog(ring_blocks=1 << 62)
        self.store.observe(self.drops)
        self._expired_now: set[BlockHash] = set()

    @property
    def tier_names(self) -> list[str]:
        return list(self._tier_names)

    def _advance(self, time: float) -> None:
        """The clock to ``time`` (replay seconds), sweeping on the way as the service would,
        and with a prefetch, running its pass at the last tick before ``time``."""
        if self.prefetch is not None:
            now = self.clock.now() - CLOCK_START
            last = (math.ceil(time / TICK_S) - 1) * TICK_S  # the last tick before ``time``
            ticks = [
                k * PREFETCH_TICK_S
                for k in range(
                    math.floor(now / PREFETCH_TICK_S) + 1, math.ceil(last / PREFETCH_TICK_S)
                )
            ]
            for tick in [*ticks, last]:
                if tick > self.clock.now() - CLOCK_START:
                    self._advance_to(tick)
                    self.prefetch.tick()
                    self.prefetch.drain()
        self._advance_to(time)

    def _returns(self, key: SessionKey) -> float | None:
        """The oracle: the session's next arrival after now (clock seconds)."""
        times = self._arrivals.get(key[1])
        if not times:
            return None
        at = bisect.bisect_right(times, self.clock.now())  # clock seconds, as the clock is set
        return times[at] if at < len(times) else None

    def _tell(self, session: str) -> None:
        """The oracle's hint: when ``session`` is next back, or that it is done."""
        assert self.sessions is not None
        back = self._returns((OPEN_TENANT, session))
        now = self.clock.now()
        hint = Hint(final=True) if back is None else Hint(back_in_s=max(MIN_GAP_S, back - now))
        with contextlib.suppress(SessionCacheError):  # swept meanwhile
            self.sessions.hint(session, hint)

    def _advance_to(self, time: float) -> None:
        if time >= self._next_sweep:
            last = math.floor(time / self._sweep_s) * self._sweep_s
            self.clock.set(CLOCK_START + last)
            self._sweep()
            self._next_sweep = last + self._sweep_s
        self.clock.set(CLOCK_START + time)

    def finish(self, request: Request) -> None:
        """``request`` has just finished: the connector passes its finish reason."""
        if self.sessions is None or request.session is None or request.stop is None:
            return
        self._advance(request.finished)
        with contextlib.suppress(SessionCacheError):  # swept meanwhile, or a reason unknown
            self.sessions.record(request.session, finish_reason=request.stop)
        if self._hints:
            self._tell(request.session)

    def serve(self, request: Request) -> list[int]:
        self._advance(request.time)
        hashes = self._hashes(request.ids)
        sessions, store, session = self.sessions, self.store, request.session
        if sessions is not None and session is not None:
            self._ensure_open(sessions, session, request.parent)
            match = sessions.lookup(session, hashes, lease_s=LOAD_LEASE_S)
        else:
            match = store.reads.lookup(hashes, lease_s=LOAD_LEASE_S)
        index = self._tier_index
        tiers = [index[t] for t in match.tiers]
        for block_hash, tier in zip(match.hashes, tiers, strict=True):
            if tier:
                with contextlib.suppress(SessionCacheError):
                    store.reads.get(block_hash)  # the engine's load: promotes a lower-tier hit
        if match.lease is not None:
            store.reads.release(match.lease.id)  # loaded
        matched = match.num_blocks
        self._expired_now = set()
        if matched < len(hashes) and store.reads.meta(hashes[matched]) is not None:
            now = self.clock.now()  # held, but past its TTL (not swept yet)
            self._expired_now = {
                h
                for h in hashes[matched:]
                if (m := store.reads.meta(h)) is not None and m.expired(now)
            }
        if matched < len(hashes):
            parent = match.hashes[-1] if match.hashes else None
            if session is not None and self.node is not None:
                self._dropped += self._store_in_session(session, parent, request.ids[matched:])
            else:
                new = hashes[matched:]
                payloads = [self._payload] * len(new)
                result = store.writes.put(new, payloads, namespace_root=self._root, parent=parent)
                self._dropped += len(result.dropped)
        if self._hints and session is not None:
            self._tell(session)
        return tiers

    def _store_in_session(self, session: str, parent: BlockHash | None, ids: Sequence[int]) -> int:
        """A STORE of the trace blocks ``ids`` after ``parent`` on behalf of ``session``,
        through the operation layer; how many blocks were dropped."""
        node, caller = self.node, self._caller
        assert node is not None
        units = b"".join(block.to_bytes(16, "little") for block in ids)
        request = StoreRequest(
            self._root, parent, 4, len(ids), self._block_bytes, units, session_id=session
        )
        plan = stores.plan_store(node, caller, request)
        for i in range(len(ids)):
            if stores.store_block(node, plan, i, self._payload) is BlockStatus.DROPPED:
                break  # the rest hangs off it: dropped
        status = plan.status
        stores.complete(node, caller, plan, kept(status))
        return status.count(BlockStatus.DROPPED)

    def why_missing(self, block: int) -> str:
        block_hash = self._ids.get(block)
        if block_hash is None:
            return "evicted"
        if block_hash in self._expired_now:
            return "expired"
        drop = self.drops.find(block_hash)
        return "expired" if drop is not None and drop.expired else "evicted"

    def _ensure_open(self, sessions: SessionManager, session: str, parent: str | None) -> None:
        try:
            sessions.get(session)
        except SessionNotFound:
            if session in self._opened:
                self._session_reopens += 1  # it expired: the client opens it again
                self._sweep()
            self._opened.add(session)
            sessions.open(session, kind=self._kind, parent=parent)

    def _sweep(self) -> None:
        self._sweeps += 1
        if self.sessions is not None:
            self.sessions.sweep()
        else:
            self.store.writes.expire()

    def _hashes(self, ids: Sequence[int]) -> list[BlockHash]:
        cache = self._ids
        out: list[BlockHash] = []
        parent = self._root
        for block in ids:
            block_hash = cache.get(block)
            if block_hash is None:  # the node's id of the block: trace ids are chained
                unit = block.to_bytes(16, "little")
                (block_hash,) = block_hashes_from_bytes(parent, unit, 4, self._seed)
                cache[block] = block_hash
            out.append(block_hash)
            parent = block_hash
        return out

    def detail(self) -> dict[str, Any]:
        stats = self.store.stats()
        out: dict[str, Any] = {
            "counters": asdict(stats.counters),
            "blocks_held": stats.blocks,
            "dropped_on_put": self._dropped,
            "sweeps": self._sweeps,
        }
        if self.prefetch is not None:
            out["prefetch"] = {
                "moved_blocks": self.prefetch.moved_blocks,
                "forecast_moves": self.prefetch.forecast_moves,
            }
        if self.sessions is not None:
            out["sessions_open"] = len(self.sessions.list_sessions())
            out["sessions_reopened_after_expiry"] = self._session_reopens
        return out

    def close(self) -> None:
        self.store.close()


def _arrivals(trace: Trace) -> dict[str, list[float]]:
    """Each session's arrival times, in order, as the replay's clock reads them then
    (``CLOCK_START`` plus the replay's seconds, the same sum: a difference taken the other
    way round can fall a rounding short of an arrival and name it as the next)."""
    out: dict[str, list[float]] = {}
    for request in trace.requests:
        if request.session is not None:
            out.setdefault(request.session, []).append(CLOCK_START + request.time)
    return out
