"""The global block index: which nodes of the fleet hold which blocks, and in which tiers.

Every node registers in Redis and publishes the blocks its tiers hold; a lookup on any node
can then say, per block, where in the fleet it lives (``locations``). Keys, under a
deployment-wide ``prefix``::

    {prefix}nodes            ZSET   member "{node_id}#{incarnation}" -> heartbeat deadline (ms)
    {prefix}node:{member}    STRING JSON info about the node (URL, tiers, start time), PX ttl
    {prefix}loc:{hex}        HASH   field "{member}|{tier}" -> publish time (ms)
                                    key expiry: PEXPIREAT (latest block expiry + grace), NX|GT

A node's *member* changes with every process start (a random incarnation), so entries a dead
or restarted process left behind stop counting the moment its heartbeat lapses: readers keep
only fields whose member has a live deadline in ``{prefix}nodes`` (fetched at most once a
second, and again when an unknown member shows up). Fields of a lapsed member are hidden but
kept (it may only be slow); fields of a member gone from the set (deregistered, or lapsed for
``10 * ttl_s`` and pruned) are deleted by the readers that meet them. Withdrawals remove
fields; the key's expiry is only the garbage collector of last resort.

Each location key hashes to its own slot (no hash tags), so a cluster spreads the index over
every shard; ``{prefix}nodes`` is one small key read about once a second per node.

Publishing from the hot path (store observers run under the store's lock) only updates a
coalescing in-memory queue: the latest operation per (block, tier) wins, expiry refreshes
(``touch``) are merged per block and sent at most every ``touch_interval_s``. A background
thread (``start()``/``stop()``; none is started by the constructor) flushes the queue every
``flush_interval_s`` in pipelined batches and sends the heartbeat every ``ttl_s / 3``.

Degradation: Redis unreachable -> ``locations`` answers empty maps, ``publish``/``withdraw``
keep queueing (bounded by ``max_pending``; overflow is dropped and remembered), ``problem()``
says why. When Redis answers again the thread re-registers. If Redis lost our registration
(restarted empty) or queued operations were dropped, the node takes a new incarnation, which
voids everything it published before, and republishes what it holds from the ``held``
callback.

Times are wall-clock (``time.time()``): nodes' clocks must agree to well within ``ttl_s``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import redis.exceptions as rex

from sessioncache.background import BackgroundLoop
from sessioncache.errors import InvalidInput, TierUnavailable
from sessioncache.hashing import BlockHash
from sessioncache.redis_link import Client, LinkStatus, RedisLink
from sessioncache.store.blocks import BlockMeta
from sessioncache.store.events import Touched

__all__ = ["FleetIndex", "FleetObserver", "NodeInfo"]

logger = logging.getLogger("sessioncache.fleet")

HeldFn = Callable[[], Iterable[tuple[BlockHash, str, float]]]
"""Everything a node holds now: ``(block id, tier name, expires_at)`` triples."""

_PIPELINE_OPS = 1000


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A live node as ``FleetIndex.nodes`` reports it."""

    node_id: str
    incarnation: str
    deadline: float
    """Wall-clock time its heartbeat lapses unless renewed."""
    info: dict[str, Any]


class FleetIndex:
    """This node's view of, and contribution to, the fleet-wide block index."""

    def __init__(
        self,
        client: Client | Callable[[], Client] | RedisLink,
        node_id: str,
        *,
        prefix: str = "sc:",
        ttl_s: float = 15.0,
        info: Mapping[str, Any] | None = None,
        held: HeldFn | None = None,
        flush_interval_s: float = 0.05,
        touch_interval_s: float = 10.0,
        gc_grace_s: float = 3600.0,
        max_pending: int = 1_000_000,
        probe_interval_s: float = 1.0,
        live_cache_s: float = 1.0,
    ) -> None:
        if not node_id or any(ch in node_id for ch in "#|") or len(node_id) > 200:
            raise InvalidInput(f"node id must be 1-200 characters without '#' or '|': {node_id!r}")
        if ttl_s <= 0:
            raise InvalidInput(f"ttl_s must be positive, got {ttl_s}")
        self.link: Final = RedisLink.of(
            client, name="fleet index", probe_interval_s=probe_interval_s
        )
        self.node_id: Final = node_id
        self._prefix = prefix
        self._ttl = ttl_s
        self._info = dict(info or {})
        self._held = held
        self._flush_interval = flush_interval_s
        self._touch_interval = touch_interval_s
        self._grace = max(gc_grace_s, 2 * touch_interval_s)
        self._max_pending = max_pending
        self._live_cache_s = live_cache_s
        self._lock = threading.Lock()
        self._incarnation = secrets.token_hex(6)
        self._started_at = time.time()
        self._ops: dict[tuple[BlockHash, str], float | None] = {}  # None: withdraw
        self._touches: dict[BlockHash, float] = {}
        self._cleanup: set[tuple[str, str]] = set()
        self._tiers_seen: set[str] = set()
        self._next_touch_flush = 0.0
        self._registered = False
        self._member_registered: str | None = None
        self._needs_resync = False
        self._void = False
        self._dropped = 0
        self._live: dict[str, float] = {}
        self._live_at = float("-inf")
        self._loop = BackgroundLoop("fleet-index", self.tick, flush_interval_s)
        self._next_heartbeat = 0.0
        self.link.on_recover(self._recovered)

    # -- identity and state ----------------------------------------------------------------

    @property
    def member(self) -> str:
        """``{node_id}#{incarnation}``: this process's name in the index."""
        return f"{self.node_id}#{self._incarnation}"

    @property
    def registered(self) -> bool:
        return self._registered

    @property
    def pending(self) -> int:
        """Queued operations not yet sent."""
        with self._lock:
            return len(self._ops) + len(self._touches)

    @property
    def dropped(self) -> int:
        """Operations dropped because the queue was full while Redis was away."""
        return self._dropped

    def problem(self) -> str | None:
        """None when the index is reachable and this node is registered; else why not."""
        problem = self.link.problem()
        if problem is None and not self._registered:
            return "fleet index: node not registered yet"
        return problem

    def status(self) -> LinkStatus:
        return self.link.status()

    # -- registration ----------------------------------------------------------------------

    def register(self) -> bool:
        """Announce (or renew) this node: heartbeat key with expiry and its entry in the node
        set. Returns False when Redis is unreachable. Notices when Redis lost this process's
        registration (restarted empty) and schedules a republication."""
        now = time.time()
        deadline_ms = int((now + self._ttl) * 1000)
        member = self.member
        info = json.dumps(
            {**self._info, "node_id": self.node_id, "started_at": self._started_at}
        ).encode()
        nodes_key, node_key = self._nodes_key(), self._node_key(member)

        def op(c: Client) -> list[Any]:
            pipe = c.pipeline(transaction=False)
            pipe.zadd(nodes_key, {member: deadline_ms})
            pipe.set(node_key, info, px=int(self._ttl * 1000))
            # Forget members whose heartbeat lapsed long ago (their fields are voided already).
            pipe.zremrangebyscore(nodes_key, "-inf", int((now - 10 * self._ttl) * 1000))
            return cast(list[Any], pipe.execute())

        try:
            added = self.link.run(op)[0]
        except (TierUnavailable, rex.RedisError) as exc:
            logger.debug("fleet index: register failed: %s", exc)
            return False
        with self._lock:
            known = self._member_registered == member
            self._member_registered = member
            self._registered = True
            self._live[member] = deadline_ms / 1000.0
            if added and known:
                logger.warning("fleet index lost the registration of %s; republishing", member)
                self._needs_resync = self._void = True
        self._next_heartbeat = time.monotonic() + self._ttl / 3
        return True

    def deregister(self) -> None:
        """Leave the index (locations published by this process stop counting at once)."""
        member = self.member

        def op(c: Client) -> None:
            pipe = c.pipeline(transaction=False)
            pipe.zrem(self._nodes_key(), member)
            pipe.delete(self._node_key(member))
            pipe.execute()

        try:
            self.link.run(op)
        except (TierUnavailable, rex.RedisError) as exc:
            logger.debug("fleet index: deregister failed: %s", exc)
        self._registered = False

    def nodes(self) -> dict[str, NodeInfo]:
        """The live nodes, by node id (the newest incarnation when a node id shows twice)."""
        now = time.time()

        def op(c: Client) -> tuple[list[tuple[bytes, float]], list[Any]]:
            members = cast(
                list[tuple[bytes, float]],
                c.zrangebyscore(self._nodes_key(), int(now * 1000), "+inf", withscores=True),
            )
            pipe = c.pipeline(transaction=False)
            for m, _ in members:
                pipe.get(self._node_key(m.decode()))
            return members, cast(list[Any], pipe.execute(raise_on_error=False))

        try:
            members, infos = self.link.run(op)
        except (TierUnavailable, rex.RedisError):
            return {}
        out: dict[str, NodeInfo] = {}
        for (raw, score), blob in zip(members, infos, strict=True):
            node_id, _, incarnation = raw.decode().partition("#")
            try:
                info = json.loads(blob) if isinstance(blob, bytes) else {}
            except ValueError:
                info = {}
            node = NodeInfo(node_id, incarnation, score / 1000.0, info)
            if node_id not in out or node.info.get("started_at", 0) >= out[node_id].info.get(
                "started_at", 0
            ):
                out[node_id] = node
        return out

    # -- publishing (non-blocking) ---------------------------------------------------------

    def set_held(self, held: HeldFn) -> None:
        """Name what this node holds, for republishing (when the store is built after the
        index, as it observes the store)."""
        self._held = held

    def publish(self, held: Sequence[tuple[BlockHash, str]], expires_at: float) -> None:
        """Queue: this node holds each block in that tier until ``expires_at``."""
        with self._lock:
            for block_hash, tier in held:
                if (block_hash, tier) not in self._ops and self._full():
                    self._dropped += 1
                    self._needs_resync = self._void = True
                    continue
                self._tiers_seen.add(tier)
                self._ops[(block_hash, tier)] = expires_at

    def withdraw(self, hashes: Sequence[BlockHash], tier: str | None = None) -> None:
        """Queue: this node no longer holds the blocks in ``tier`` (every tier when None)."""
        with self._lock:
            tiers = [tier] if tier is not None else sorted(self._tiers_seen)
            for block_hash in hashes:
                for name in tiers:
                    if (block_hash, name) not in self._ops and self._full():
                        self._dropped += 1
                        self._needs_resync = self._void = True
                        continue
                    self._ops[(block_hash, name)] = None

    def touch(self, items: Sequence[tuple[BlockHash, float]]) -> None:
        """Queue: these blocks now live until at least the given times (sent at most every
        ``touch_interval_s``; only the location keys' expiry moves)."""
        with self._lock:
            touches = self._touches
            for block_hash, expires_at in items:
                old = touches.get(block_hash)
                if old is None:
                    if self._full():
                        continue  # a lost touch only shortens a garbage-collection deadline
                    touches[block_hash] = expires_at
                elif expires_at > old:
                    touches[block_hash] = expires_at

    def _full(self) -> bool:
        return len(self._ops) + len(self._touches) >= self._max_pending

    def flush(self, *, touches: bool | None = None) -> int:
        """Send queued operations now (the thread calls this); returns how many were sent.
        ``touches``: also send queued expiry refreshes (default: when their interval is due).
        Nothing is sent before ``register()`` succeeds; operations that could not be sent stay
        queued (newer ones win)."""
        if not self._registered:
            return 0  # fields of an unregistered member would be void: keep them queued
        now_mono = time.monotonic()
        with self._lock:
            ops, self._ops = self._ops, {}
            send_touches = touches if touches is not None else now_mono >= self._next_touch_flush
            if send_touches:
                touched, self._touches = self._touches, {}
                self._next_touch_flush = now_mono + self._touch_interval
            else:
                touched = {}
            cleanup, self._cleanup = self._cleanup, set()
        if not ops and not touched and not cleanup:
            return 0
        entries: list[tuple[str, BlockHash, str | None, float | None]] = [
            ("op", h, tier, exp) for (h, tier), exp in ops.items()
        ]
        entries += [("touch", h, None, exp) for h, exp in touched.items()]
        sent = 0
        try:
            for start in range(0, len(entries), _PIPELINE_OPS):
                self._send(entries[start : start + _PIPELINE_OPS])
                sent += len(entries[start : start + _PIPELINE_OPS])
            if cleanup:
                self._send_cleanup(cleanup)
        except (TierUnavailable, rex.RedisError) as exc:
            logger.debug("fleet index: flush failed: %s", exc)
            self._requeue(entries[sent:], cleanup)
        return sent

    def _send(self, entries: list[tuple[str, BlockHash, str | None, float | None]]) -> None:
        member = self.member
        now_ms = str(int(time.time() * 1000))

        def op(c: Client) -> None:
            pipe = c.pipeline(transaction=False)
            for kind, block_hash, tier, exp in entries:
                key = self._loc_key(block_hash)
                if kind == "op" and exp is None:
                    pipe.hdel(key, f"{member}|{tier}")
                    continue
                if kind == "op":
                    pipe.hset(key, f"{member}|{tier}", now_ms)
                assert exp is not None
                gc_ms = int((exp + self._grace) * 1000)
                if kind == "op":
                    pipe.pexpireat(key, gc_ms, nx=True)  # a fresh hash has no expiry yet
                pipe.pexpireat(key, gc_ms, gt=True)
            pipe.execute()

        self.link.run(op)

    def _send_cleanup(self, cleanup: set[tuple[str, str]]) -> None:
        def op(c: Client) -> None:
            pipe = c.pipeline(transaction=False)
            for key, field in cleanup:
                pipe.hdel(key, field)
            pipe.execute(raise_on_error=False)

        self.link.run(op)

    def _requeue(
        self, entries: list[tuple[str, BlockHash, str | None, float | None]], cleanup: set[Any]
    ) -> None:
        with self._lock:
            for kind, block_hash, tier, exp in entries:
                if kind == "touch":
                    assert exp is not None
                    if block_hash not in self._touches and self._full():
                        continue
                    self._touches[block_hash] = max(exp, self._touches.get(block_hash, exp))
                    continue
                assert tier is not None
                if (block_hash, tier) in self._ops:
                    continue  # a newer operation on it arrived meanwhile
                if self._full():
                    self._dropped += 1
                    self._needs_resync = self._void = True
                    continue
                self._ops[(block_hash, tier)] = exp
            if len(self._cleanup) < 100_000:
                self._cleanup |= cleanup

    # -- reading ---------------------------------------------------------------------------

    def locations(self, hashes: Sequence[BlockHash]) -> list[dict[str, list[str]]]:
        """For each block, ``{node_id: [tier, ...]}`` over the live nodes of the fleet (this
        one included), in one pipelined round trip (two when a new node appears). Empty maps
        when Redis is unreachable."""
        if not hashes:
            return []
        keys = [self._loc_key(h) for h in hashes]

        def op(c: Client) -> list[Any]:
            pipe = c.pipeline(transaction=False)
            for k in keys:
                pipe.hgetall(k)
            return cast(list[Any], pipe.execute(raise_on_error=False))

        try:
            replies = self.link.run(op)
            live = self._live_members(refresh=False)
            unknown = any(
                (f.decode() if isinstance(f, bytes) else f).partition("|")[0] not in live
                for reply in replies
                if isinstance(reply, dict)
                for f in reply
            )
            if unknown:
                live = self._live_members(refresh=True)
        except (TierUnavailable, rex.RedisError):
            return [{} for _ in hashes]
        now = time.time()
        out: list[dict[str, list[str]]] = []
        stale: list[tuple[str, str]] = []
        for key, reply in zip(keys, replies, strict=True):
            found: dict[str, list[str]] = {}
            if isinstance(reply, dict):
                for raw in reply:
                    field = raw.decode() if isinstance(raw, bytes) else str(raw)
                    member, _, tier = field.partition("|")
                    deadline = live.get(member)
                    if deadline is None:  # left, or lapsed long ago and pruned: void
                        stale.append((key, field))
                        continue
                    if deadline <= now:  # lapsed: hidden, kept in case it comes back
                        continue
                    found.setdefault(member.partition("#")[0], []).append(tier)
            for tiers in found.values():
                tiers.sort()
            out.append(found)
        if stale:
            with self._lock:
                if len(self._cleanup) < 100_000:
                    self._cleanup.update(stale)
        return out

    def _live_members(self, *, refresh: bool) -> dict[str, float]:
        """Member -> heartbeat deadline (s), including lapsed ones still in the set; cached
        for ``live_cache_s``."""
        now_mono = time.monotonic()
        with self._lock:
            if not refresh and now_mono - self._live_at < self._live_cache_s:
                return self._live
        raw = self.link.run(
            lambda c: cast(
                list[tuple[bytes, float]],
                c.zrange(self._nodes_key(), 0, -1, withscores=True),
            )
        )
        live = {m.decode(): score / 1000.0 for m, score in raw}
        with self._lock:
            self._live, self._live_at = live, now_mono
        return live

    # -- background thread -----------------------------------------------------------------

    def start(self) -> None:
        """Register (if Redis answers: one round trip, or a fast failure) and start the
        thread, which first publishes what ``held`` reports, then flushes the queue and
        sends heartbeats."""
        if self._loop.running:
            return
        if self._held is not None:
            self._needs_resync = True  # the thread publishes what the node holds first
        self.register()
        self._loop.start()

    def stop(self, *, deregister: bool = True, timeout_s: float = 5.0) -> None:
        """Stop the thread after a last flush; ``deregister`` leaves the index."""
        self._loop.stop(timeout_s)
        self.flush(touches=True)
        if deregister:
            self.deregister()

    def close(self) -> None:
        """``stop()`` and close the client if this index made it."""
        self.stop()
        self.link.close()

    def tick(self) -> None:
        """One round of the background work (heartbeat when due, resync, flush); the thread
        calls it every ``flush_interval_s``. Never raises for a Redis outage."""
        if not self.link.healthy and self.link.problem() is not None:
            return
        due = not self._registered or time.monotonic() >= self._next_heartbeat
        if due and not self.register():
            return
        if self._needs_resync:
            self._resync()
        self.flush()

    def _recovered(self) -> None:
        # Called in whichever thread's probe found Redis back: only flag, no I/O here.
        self._registered = False

    def _resync(self) -> None:
        """Republish what this node holds (from ``held``). When earlier publications may be
        wrong (Redis lost them, or queued operations were dropped), first take a new
        incarnation, which voids everything the old one published."""
        with self._lock:
            void, self._void, self._needs_resync = self._void, False, False
        if self._held is None:
            if void:
                logger.warning("fleet index: publications were lost and no `held` to redo them")
            return
        if void:
            old = self.member
            self._incarnation = secrets.token_hex(6)
            if not self.register():
                with self._lock:
                    self._needs_resync = self._void = True
                return
            with contextlib.suppress(TierUnavailable, rex.RedisError):
                self.link.run(lambda c: c.zrem(self._nodes_key(), old))
        batch: list[tuple[str, BlockHash, str | None, float | None]] = []
        count = 0
        try:
            for block_hash, tier, expires_at in self._held():
                with self._lock:
                    self._tiers_seen.add(tier)
                batch.append(("op", block_hash, tier, expires_at))
                if len(batch) >= _PIPELINE_OPS:
                    self._send(batch)
                    count += len(batch)
                    batch = []
            if batch:
                self._send(batch)
                count += len(batch)
        except (TierUnavailable, rex.RedisError) as exc:
            logger.warning("fleet index: republication interrupted: %s", exc)
            with self._lock:
                self._needs_resync = True
                self._void = self._void or void
            return
        logger.info("fleet index: published %d holdings as %s", count, self.member)

    # -- keys ------------------------------------------------------------------------------

    def _nodes_key(self) -> str:
        return f"{self._prefix}nodes"

    def _node_key(self, member: str) -> str:
        return f"{self._prefix}node:{member}"

    def _loc_key(self, block_hash: bytes) -> str:
        return f"{self._prefix}loc:{block_hash.hex()}"


class FleetObserver:
    """A ``StoreObserver`` feeding a ``FleetIndex`` from the store's events (queued, never
    blocking). ``exclude``: tiers not to publish (the shared Redis tier is the fleet's, not
    a node's)."""

    def __init__(self, fleet: FleetIndex, exclude: Collection[str] = ()) -> None:
        self._fleet = fleet
        self._exclude = set(exclude)

    def block_added(self, meta: BlockMeta, tier: str, durable: bool) -> None:
        if tier not in self._exclude:
            self._fleet.publish([(meta.block_hash, tier)], meta.expires_at)

    def block_removed(self, block_hash: BlockHash, tier: str, durable: bool) -> None:
        if tier not in self._exclude:
            self._fleet.withdraw([block_hash], tier)

    def blocks_touched(self, touched: Touched) -> None:
        self._fleet.touch(
            [
                (h, expires)
                for h, mask, expires in zip(
                    touched.hashes, touched.masks, touched.expires_at, strict=False
                )
                if mask
            ]
        )
