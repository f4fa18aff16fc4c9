"""The shared tier: block payloads in Redis (or Redis Cluster), visible to every node.

One key per block, ``{prefix}b:{hex}`` (``hex`` = 32 hex digits of the id), holds the 88-byte
block header of ``tiers/header.py`` (magic ``b"SCRBLK\\x00\\x01"``) followed by the payload,
so a reader sees the whole block or nothing.

Every key carries the block's absolute expiry (``SET ... PXAT`` on write, ``PEXPIREAT ... GT``
when a node extends it, so the longest-lived claim of any node wins); Redis drops expired
blocks by itself. A read verifies magic, version, both checksums, the id and the length; a
mismatch is a miss and the key is deleted. ``locate_many`` reads only the header
(``GETRANGE 0 87``) and the expiry (``PEXPIRETIME``): it says what the fleet holds without
moving payloads.

No hash tags: each block key lands on the slot of its own name, so one namespace (or one long
chain) spreads over every shard of a cluster instead of making one shard hot. Batches are
non-transactional pipelines; redis-py splits them per node on a cluster. Needs Redis >= 7.0
(``PEXPIREAT ... GT``, ``PEXPIRETIME``).

Capacity: Redis is shared, so ``used_bytes`` counts what *this node* wrote and has neither
deleted nor seen expire (expiry is tracked locally from the expiry each write carried);
``fits`` is a local check that costs no round trip. Blocks written by other nodes, or dropped
by Redis' own ``maxmemory`` policy, are not reflected: size each node's ``capacity_bytes`` as
its share of the Redis memory and let ``maxmemory`` + ``volatile-lru`` be the hard guard (see
``docs/scale-out.md``). ``server_memory()`` reads the real figure from ``INFO memory``.

Degradation: every data call that meets a connection error, timeout or cluster outage behaves
as a miss (``get`` -> None, ``contains`` -> False, ``delete`` -> 0) or raises
``TierUnavailable`` (``put``, a ``TierFull`` the store already knows how to handle). The
client and its health are a ``RedisLink`` (``sessioncache.redis_link``): while it is
degraded, calls fail at once without touching the network until a probe answers.
``problem()`` reports the state for ``/readyz``.

Expiry times are wall-clock seconds since the epoch (``time.time()``), like the store's
``SystemClock``.

Speed: the write path on the wire (batches, pipelined groups that overlap checksums with the
transfer, zero-copy values) is ``BlockWriter`` (``tiers/redis_writer.py``). ``get`` returns a
zero-copy view of the reply. Figures beside raw redis-py ``SET``/``GET``: docs/benchmarks.md,
"Shared tier".
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar, cast

import redis.exceptions as rex
import torch
from redis.cluster import RedisCluster

from sessioncache.codecs import CODEC_IDS, CodecTable, decode_block, encode_or_raw
from sessioncache.errors import InvalidInput, TierFull
from sessioncache.hashing import HASH_BYTES, BlockHash, payload_checksum
from sessioncache.redis_link import (
    Client,
    LinkStatus,
    RedisLink,
    TierUnavailable,
    describe_error,
)
from sessioncache.tiers.base import LocatedBlock, PutItem
from sessioncache.tiers.header import (
    HEADER,
    HEADER_SIZE,
    VERSION,
    HeaderCodec,
    InvalidBlock,
    check_id,
)
from sessioncache.tiers.payload import as_memoryview, checked_nbytes
from sessioncache.tiers.redis_writer import BlockWriter, Outgoing

__all__ = [
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "VERSION",
    "RedisCounters",
    "RedisTier",
]

logger = logging.getLogger("sessioncache.tiers.redis")

MAGIC = b"SCRBLK\x00\x01"
_CODEC = HeaderCodec(MAGIC)
encode_header = _CODEC.encode
decode_header = _CODEC.decode
_T = TypeVar("_T")


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, rex.OutOfMemoryError) or str(exc).startswith("OOM")


# ------------------------------------------------------------------------------------- tier


@dataclass(slots=True)
class RedisCounters:
    """What this node's tier did, for ``/metrics``."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    corrupt_located: int = 0
    """Values ``locate_many`` found damaged (their header does not describe the block asked
    for): deleted and never adopted, so no ``get`` ever sees them."""
    stored: int = 0
    unavailable: int = 0
    """Calls answered as a miss / ``TierUnavailable`` because Redis was unreachable."""


@dataclass(slots=True)
class _Own:
    nbytes: int
    expires_at: float


_MIN_TTL_S = 1.0


class UnknownCodec(InvalidBlock):
    """A value written with a codec this node does not know: not corrupt, not readable here."""


def _warn_corrupt(tier: str, block_hash: BlockHash, exc: InvalidBlock) -> None:
    logger.warning("%s tier: block %s is corrupt (%s); deleting it", tier, block_hash.hex(), exc)


class RedisTier:
    """Block payloads in Redis, shared by every node (see the module docstring)."""

    def __init__(
        self,
        client: Client | Callable[[], Client] | RedisLink,
        capacity_bytes: int,
        *,
        name: str = "redis",
        prefix: str = "sc:",
        default_ttl_s: float = 3 * 86400.0,
        durable: bool = False,
        owns_keys: bool = False,
        probe_interval_s: float = 1.0,
        skip_existing: bool = False,
        max_batch_bytes: int = 64 << 20,
        buffer_pool_bytes: int = 128 << 20,
        codecs: CodecTable | None = None,
    ) -> None:
        """``codecs``: how each namespace's blocks are stored (default: all raw); a value
        says its own codec, so any node reads what any other wrote."""
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if default_ttl_s <= 0:
            raise ValueError(f"default_ttl_s must be positive, got {default_ttl_s}")
        self.link: Final = RedisLink.of(client, name=name, probe_interval_s=probe_interval_s)
        self.name: Final = name
        self.capacity_bytes: Final = capacity_bytes
        self.prefix: Final = prefix
        self.durable: Final = durable
        self._block_prefix = f"{prefix}b:"
        self._default_ttl = default_ttl_s
        self._owns_keys = owns_keys
        self._codecs = codecs if codecs is not None else CodecTable()
        self._writer = BlockWriter(
            self.link,
            _CODEC,
            self.key,
            name=name,
            skip_existing=skip_existing,
            max_batch_bytes=max_batch_bytes,
            buffer_pool_bytes=buffer_pool_bytes,
        )
        self._lock = threading.Lock()
        self._own: dict[BlockHash, _Own] = {}
        self._expiry_heap: list[tuple[float, BlockHash]] = []
        self._used = 0
        self._reserved = 0
        self._counters = RedisCounters()

    # -- properties ------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Payload bytes this node wrote that are neither deleted nor expired (approximate:
        see the module docstring)."""
        with self._lock:
            self._reap(time.time())
            return self._used

    def key(self, block_hash: bytes) -> str:
        """The Redis key of a block."""
        return f"{self._block_prefix}{block_hash.hex()}"

    def problem(self) -> str | None:
        return self.link.problem()

    def status(self) -> LinkStatus:
        return self.link.status()

    def counters(self) -> RedisCounters:
        with self._lock:
            return RedisCounters(**{f: getattr(self._counters, f) for f in _COUNTER_FIELDS})

    def fits(self, nbytes: int) -> bool:
        with self._lock:
            self._reap(time.time())
            return nbytes > 0 and self._used + self._reserved + nbytes <= self.capacity_bytes

    # -- reads -----------------------------------------------------------------------------

    def contains(self, block_hash: BlockHash) -> bool:
        key = self.key(block_hash)
        try:
            return bool(self._run(lambda c: c.exists(key)))
        except (TierUnavailable, rex.RedisError):
            return False

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        return self.get_many([block_hash])[0]

    def get_many(self, hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        """The payloads of ``hashes`` (None for each miss), in one pipelined round trip.

        Each tensor is a zero-copy, read-only view of the bytes Redis returned: do not write
        through it. A value that fails verification is a miss and its key is deleted.
        """
        if not hashes:
            return []
        keys = [self.key(h) for h in hashes]
        try:
            raws = self.link.pipeline(lambda p: [p.get(k) for k in keys], raise_errors=False)
        except (TierUnavailable, rex.RedisError) as exc:
            self._note_unavailable(exc, len(hashes))
            return [None] * len(hashes)
        out: list[torch.Tensor | None] = []
        corrupt: list[BlockHash] = []
        for block_hash, raw in zip(hashes, raws, strict=True):
            if raw is None:
                out.append(None)
                continue
            try:
                if isinstance(raw, Exception):  # WRONGTYPE: something else took the key
                    raise InvalidBlock(describe_error(raw))
                out.append(self._decode(block_hash, cast(bytes, raw)))
            except UnknownCodec:
                out.append(None)  # a miss here; the value stays, for the nodes that read it
            except InvalidBlock as exc:
                _warn_corrupt(self.name, block_hash, exc)
                corrupt.append(block_hash)
                out.append(None)
        hits = sum(1 for t in out if t is not None)
        with self._lock:
            self._counters.hits += hits
            self._counters.misses += len(out) - hits
            self._counters.corrupt += len(corrupt)
        if corrupt:
            self.delete_many(corrupt)
        return out

    def _decode(self, block_hash: bytes, raw: bytes) -> torch.Tensor:
        if not isinstance(raw, bytes):
            raise InvalidBlock(f"value is {type(raw).__name__}, not bytes")
        header = decode_header(raw)
        if header.block_hash != block_hash:
            raise InvalidBlock("block id in header does not match the key")
        if header.nbytes == 0 or len(raw) != HEADER_SIZE + header.nbytes:
            raise InvalidBlock(
                f"value is {len(raw)} bytes, header says {HEADER_SIZE + header.nbytes}"
            )
        if payload_checksum(memoryview(raw)[HEADER_SIZE:]) != header.checksum:
            raise InvalidBlock("payload checksum mismatch")
        if header.codec:
            if header.codec not in CODEC_IDS.values():
                raise UnknownCodec(f"codec {header.codec}, from a newer node")
            try:
                block = decode_block(header.codec, memoryview(raw)[HEADER_SIZE:], header.raw_nbytes)
            except InvalidInput as exc:
                raise InvalidBlock(f"cannot decode: {exc}") from None
            return torch.from_numpy(block)
        return torch.frombuffer(raw, dtype=torch.uint8, count=header.nbytes, offset=HEADER_SIZE)

    def locate_many(self, hashes: Sequence[BlockHash]) -> list[LocatedBlock | None]:
        """For each id, what Redis holds of it (from the header alone), or None.

        One pipelined round trip of ``GETRANGE key 0 87`` + ``PEXPIRETIME key`` per block:
        a few hundred bytes per block whatever the payload size. All None when Redis is down.
        """
        if not hashes:
            return []
        keys = [self.key(h) for h in hashes]

        def queue(p: Any) -> None:
            for k in keys:
                p.getrange(k, 0, HEADER_SIZE - 1)
                p.pexpiretime(k)

        try:
            replies = self.link.pipeline(queue, raise_errors=False)
        except (TierUnavailable, rex.RedisError) as exc:
            self._note_unavailable(exc, len(hashes))
            return [None] * len(hashes)
        out: list[LocatedBlock | None] = []
        damaged: list[BlockHash] = []
        for i, block_hash in enumerate(hashes):
            raw, pexp = replies[2 * i], replies[2 * i + 1]
            if not isinstance(raw, bytes) or not raw:
                out.append(None)
                continue
            try:
                header = decode_header(raw)
                if header.block_hash != block_hash or header.nbytes == 0:
                    raise InvalidBlock("header does not describe this block")
            except InvalidBlock as exc:
                # Never adopted, so no get() would ever find it corrupt: count and delete it
                # here, or it would sit in the shared tier, uncounted, until it expired.
                _warn_corrupt(self.name, block_hash, exc)
                damaged.append(block_hash)
                out.append(None)
                continue
            if pexp == -2:  # gone between the two commands
                out.append(None)
                continue
            expires = pexp / 1000.0 if isinstance(pexp, int) and pexp > 0 else None
            out.append(
                LocatedBlock(
                    block_hash,
                    header.namespace_root,
                    BlockHash(header.parent) if header.parent is not None else None,
                    header.raw_nbytes,
                    expires,
                )
            )
        if damaged:
            with self._lock:
                self._counters.corrupt_located += len(damaged)
            self.delete_many(damaged)
        return out

    def corrupt_located(self) -> int:
        """How many values ``locate_many`` found damaged and deleted, since start."""
        with self._lock:
            return self._counters.corrupt_located

    def keys(self) -> list[BlockHash]:
        """Every block under this tier's prefix, from ``SCAN`` over every shard: a snapshot of
        the whole fleet's shared tier, for tools and tests (not for a hot path)."""
        try:
            found = self._run(lambda c: list(self._scan(c)))
        except (TierUnavailable, rex.RedisError):
            return []
        out: list[BlockHash] = []
        for key in found:
            text = key.decode() if isinstance(key, bytes) else str(key)
            try:
                raw = bytes.fromhex(text[len(self._block_prefix) :])
            except ValueError:
                continue
            if len(raw) == HASH_BYTES:
                out.append(BlockHash(raw))
        return out

    def server_memory(self) -> tuple[int, int]:
        """``(used_memory, maxmemory)`` summed over every server (0 maxmemory: unlimited).
        A round trip per server: for ``/metrics`` and capacity planning, not the data path."""

        def read(c: Client) -> tuple[int, int]:
            if isinstance(c, RedisCluster):
                info = c.info("memory", target_nodes=RedisCluster.PRIMARIES)
            else:
                info = c.info("memory")
            per_node: list[dict[str, Any]] = [info]
            if isinstance(info, dict) and all(isinstance(v, dict) for v in info.values()):
                per_node = list(info.values())  # a cluster answers per node
            used = sum(int(n.get("used_memory", 0)) for n in per_node)
            limit = sum(int(n.get("maxmemory", 0)) for n in per_node)
            return used, limit

        return self._run(read)

    # -- writes ----------------------------------------------------------------------------

    def put(self, item: PutItem) -> None:
        """Store one block (a no-op when Redis already holds it, except that its expiry is
        raised to ``expires_at``). Raises ``TierFull``, ``TierUnavailable`` (a ``TierFull``),
        ``PayloadSizeError`` or ``InvalidInput``."""
        self.put_many([item])

    def put_many(self, items: Sequence[PutItem]) -> list[bool]:
        """Store several blocks in pipelined round trips; for each, whether this call wrote it
        (False: Redis already held it, or it came twice in ``items``).

        Everything is validated, and the whole batch's bytes reserved, before anything is
        sent: a batch that does not fit raises ``TierFull`` having written nothing. ``SET NX``
        never overwrites a block. With ``skip_existing`` one ``EXISTS`` round trip first keeps
        blocks Redis already holds from crossing the network again: worth it where many puts
        are duplicates (the store already skips blocks it knows are in this tier, and the
        engine recomputes only what every tier missed, so it is off by default).
        """
        now = time.time()
        prepared: list[Outgoing] = []
        seen: set[BlockHash] = set()
        for item in items:
            block_hash = check_id(item.block_hash, "block id")
            namespace_root = check_id(item.namespace_root, "namespace root")
            parent = check_id(item.parent, "parent") if item.parent is not None else None
            nbytes = checked_nbytes(item.payload, self.name, self.capacity_bytes)
            if block_hash in seen:
                continue
            seen.add(block_hash)
            expires = self._expiry(item.expires_at, now)
            view = as_memoryview(item.payload)
            codec, coded = encode_or_raw(self._codecs.for_root(namespace_root), view)
            if codec.id:
                prepared.append(
                    Outgoing(
                        block_hash,
                        coded,
                        namespace_root,
                        parent,
                        coded.nbytes,
                        expires,
                        codec.id,
                        nbytes,
                    )
                )
                continue
            prepared.append(Outgoing(block_hash, view, namespace_root, parent, nbytes, expires))
        result = dict.fromkeys((p.block_hash for p in prepared), False)
        if not prepared:
            return [False] * len(items)
        with self._lock:
            self._reap(now)
            need = sum(p.nbytes for p in prepared if p.block_hash not in self._own)
            if self._used + self._reserved + need > self.capacity_bytes:
                raise TierFull(
                    f"{self.name} tier: {need} bytes do not fit "
                    f"({self._used + self._reserved} of {self.capacity_bytes} in use by this node)"
                )
            self._reserved += need
        try:
            for batch in self._writer.batches(prepared):
                for block_hash, stored in self._put_batch(batch):
                    result[block_hash] = stored
        except (TierUnavailable, rex.RedisError) as exc:
            self._note_unavailable(exc, 1)
            if isinstance(exc, TierUnavailable):
                raise
            if _is_oom(exc):
                raise TierFull(f"{self.name} tier: Redis is out of memory: {exc}") from exc
            raise TierUnavailable(f"{self.name}: {describe_error(exc)}") from exc
        finally:
            with self._lock:
                self._reserved -= need
        out: list[bool] = []
        emitted: set[BlockHash] = set()
        for item in items:
            first = item.block_hash not in emitted
            emitted.add(item.block_hash)
            out.append(first and result.get(item.block_hash, False))
        return out

    def _put_batch(self, batch: list[Outgoing]) -> list[tuple[BlockHash, bool]]:
        """Write one batch and account it: a block this call stored becomes this node's (in
        ``used_bytes``); for one Redis already held, the expiry this node tracks is raised."""
        out: list[tuple[BlockHash, bool]] = []
        stored_now: list[Outgoing] = []
        for block, stored in zip(batch, self._writer.write(batch), strict=True):
            out.append((block.block_hash, stored))
            if stored:
                stored_now.append(block)
            else:
                self._extend_own(block.block_hash, block.expires_at)
        with self._lock:
            for block in stored_now:
                if block.block_hash not in self._own:
                    self._used += block.nbytes
                    self._own[block.block_hash] = _Own(block.nbytes, block.expires_at)
                    heapq.heappush(self._expiry_heap, (block.expires_at, block.block_hash))
            self._counters.stored += len(stored_now)
        return out

    def set_expiry(self, block_hash: BlockHash, expires_at: float) -> None:
        """Raise the block's expiry to ``expires_at`` (``PEXPIREAT ... GT``: never lowers it,
        so the node wanting it longest wins). Silently nothing when Redis is down."""
        self.set_expiry_many([(block_hash, expires_at)])

    def set_expiry_many(self, items: Sequence[tuple[BlockHash, float]]) -> None:
        if not items:
            return
        pairs = [(self.key(h), int(max(t, time.time() + _MIN_TTL_S) * 1000)) for h, t in items]
        try:
            self.link.pipeline(lambda p: [p.pexpireat(k, ms, gt=True) for k, ms in pairs])
        except (TierUnavailable, rex.RedisError) as exc:
            self._note_unavailable(exc, len(items))
            return
        for block_hash, expires_at in items:
            self._extend_own(block_hash, expires_at)

    def delete(self, block_hash: BlockHash) -> int:
        return self.delete_many([block_hash])[0]

    def delete_many(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Drop blocks from Redis; for each, the payload bytes freed (0 when absent, or when
        Redis is down: the key then lives until its expiry)."""
        if not hashes:
            return []
        with self._lock:
            for block_hash in hashes:
                own = self._own.pop(block_hash, None)
                if own is not None:
                    self._used -= own.nbytes
        keys = [self.key(h) for h in hashes]

        def queue(p: Any) -> None:
            for k in keys:
                p.strlen(k)
                p.delete(k)

        try:
            replies = self.link.pipeline(queue, raise_errors=False)
        except (TierUnavailable, rex.RedisError) as exc:
            self._note_unavailable(exc, len(hashes))
            return [0] * len(hashes)
        out: list[int] = []
        for i in range(len(hashes)):
            length, deleted = replies[2 * i], replies[2 * i + 1]
            ok = deleted == 1 and isinstance(length, int)
            freed = max(0, length - HEADER_SIZE) if ok else 0
            out.append(freed)
        return out

    def close(self) -> None:
        """Forget local accounting, delete this tier's keys if it ``owns_keys`` (tests; never
        the whole database), and close the client if the tier made it."""
        if self._owns_keys:
            try:
                self.clear_prefix()
            except (TierUnavailable, rex.RedisError) as exc:
                logger.warning("%s tier: could not delete its keys: %s", self.name, exc)
        with self._lock:
            self._own.clear()
            self._expiry_heap.clear()
            self._used = 0
        self._writer.close()
        self.link.close()

    def clear_prefix(self) -> int:
        """Delete every key under ``prefix`` (blocks and anything else there); returns how many."""
        pattern = _glob_escape(self.prefix) + "*"

        def wipe(c: Client) -> int:
            found = list(c.scan_iter(match=pattern, count=1000))
            for start in range(0, len(found), 1000):
                pipe = c.pipeline(transaction=False)
                for k in found[start : start + 1000]:
                    pipe.unlink(k)
                pipe.execute()
            return len(found)

        return self._run(wipe)

    # -- helpers ---------------------------------------------------------------------------

    def _run(self, op: Callable[[Client], _T]) -> _T:
        return self.link.run(op)

    def _scan(self, c: Client) -> Iterable[bytes | str]:
        return cast(
            Iterable[bytes | str],
            c.scan_iter(match=_glob_escape(self._block_prefix) + "*", count=1000),
        )

    def _expiry(self, expires_at: float | None, now: float) -> float:
        if expires_at is None:
            return now + self._default_ttl
        if expires_at != expires_at:
            raise InvalidInput("expires_at is NaN")
        return max(expires_at, now + _MIN_TTL_S)

    def _extend_own(self, block_hash: BlockHash, expires_at: float) -> None:
        with self._lock:
            own = self._own.get(block_hash)
            if own is not None and expires_at > own.expires_at:
                own.expires_at = expires_at
                heapq.heappush(self._expiry_heap, (expires_at, block_hash))
                if len(self._expiry_heap) > 4 * len(self._own) + 1024:
                    self._expiry_heap = [(o.expires_at, h) for h, o in self._own.items()]
                    heapq.heapify(self._expiry_heap)

    def _reap(self, now: float) -> None:
        """Forget own blocks whose expiry passed (Redis dropped them). Lock held."""
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            _, block_hash = heapq.heappop(heap)
            own = self._own.get(block_hash)
            if own is not None and own.expires_at <= now:
                del self._own[block_hash]
                self._used -= own.nbytes

    def _note_unavailable(self, exc: BaseException, calls: int) -> None:
        if not isinstance(exc, TierUnavailable):
            logger.warning("%s tier: Redis error: %s", self.name, describe_error(exc))
        with self._lock:
            self._counters.unavailable += calls


_COUNTER_FIELDS = tuple(RedisCounters.__dataclass_fields__)


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)
