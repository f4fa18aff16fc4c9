"""The Redis tier's write path on the wire: ``BlockWriter`` sends validated blocks.

``RedisTier.put_many`` (``tiers/redis.py``) validates the blocks, reserves their bytes and
keeps this node's accounting; a ``BlockWriter`` only puts them in Redis and says, for each,
whether this call stored it.

A write is ``SET key value PXAT ms NX`` then ``PEXPIREAT key ms GT``: a block is never
overwritten, and a block Redis already held (or a racing writer stored first) keeps the longer
of the two expiries. With ``skip_existing`` one ``EXISTS`` round trip first keeps blocks Redis
already holds from crossing the network again (only their expiry is raised).

Speed: a batch (at most ``max_batch_bytes``) is sent in groups of about 8 MiB: while one group
is on the wire (a worker thread, started on first use, stopped by ``close``; socket writes
release the GIL) the next is checksummed and copied (the checksum and numpy copies release it
too), so the CPU work hides behind the transfer. A client from ``make_client`` sends header and
payload as two pieces of one bulk string (``Parts``), so no value is ever assembled by copying;
other clients get copies in pooled buffers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from sessioncache.buffers import BufferPool
from sessioncache.hashing import BlockHash, payload_checksum
from sessioncache.redis_link import Parts, RedisLink, sends_parts
from sessioncache.tiers.header import HEADER_SIZE, HeaderCodec

__all__ = ["BlockWriter", "Outgoing"]

_GROUP_BYTES = 8 << 20
_SEND_WORKERS = 4

_Command = tuple[str, int, memoryview | Parts | None]
"""``(key, expiry ms, value)``; value None: raise the expiry of a block Redis holds."""


class Outgoing(NamedTuple):
    """A validated block on its way to Redis."""

    block_hash: BlockHash
    view: memoryview
    """The payload's bytes."""
    namespace_root: bytes
    parent: BlockHash | None
    nbytes: int
    """The payload's bytes as stored (``view``'s)."""
    expires_at: float
    """Wall-clock expiry the key is given (or raised to)."""
    codec: int = 0
    """The payload's codec (``sessioncache.codecs``; 0: raw)."""
    raw_nbytes: int = 0
    """The block's length once decoded (when ``codec`` is not raw)."""


class BlockWriter:
    """Writes blocks to Redis in pipelined groups (see the module docstring)."""

    def __init__(
        self,
        link: RedisLink,
        codec: HeaderCodec,
        key: Callable[[bytes], str],
        *,
        name: str,
        skip_existing: bool,
        max_batch_bytes: int,
        buffer_pool_bytes: int,
    ) -> None:
        self._link = link
        self._codec = codec
        self._key = key
        self._name = name
        self._skip_existing = skip_existing
        self._max_batch_bytes = max(1, max_batch_bytes)
        self._buffers = BufferPool(buffer_pool_bytes)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def batches(self, blocks: list[Outgoing]) -> Iterator[list[Outgoing]]:
        """``blocks`` in consecutive batches of at most ``max_batch_bytes`` (at least one block
        each): the caller accounts each batch once it is written."""
        batch: list[Outgoing] = []
        size = 0
        for block in blocks:
            if batch and size + block.nbytes > self._max_batch_bytes:
                yield batch
                batch, size = [], 0
            batch.append(block)
            size += block.nbytes
        if batch:
            yield batch

    def write(self, batch: list[Outgoing]) -> list[bool]:
        """Send one batch; for each block, whether this call stored it (False: Redis already
        held it, and its expiry was raised to the block's ``expires_at`` if later)."""
        keys = [self._key(block.block_hash) for block in batch]
        if self._skip_existing:
            present = [bool(x) for x in self._link.pipeline(lambda p: [p.exists(k) for k in keys])]
        else:
            present = [False] * len(batch)
        groups: list[list[int]] = [[]]
        size = 0
        for i, block in enumerate(batch):
            if groups[-1] and size + block.nbytes > _GROUP_BYTES:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += block.nbytes
        sends: list[Future[list[Any]]] = []
        buffers: list[list[bytearray]] = []
        replies: list[Any] = []
        try:
            for group in groups:
                commands, held_buffers = self._prepare_group(group, keys, batch, present)
                buffers.append(held_buffers)
                if len(groups) == 1:
                    replies = self._send_group(commands)
                else:
                    sends.append(self._executor().submit(self._send_group, commands))
            if sends:
                failure: BaseException | None = None
                for send in sends:
                    try:
                        replies += send.result()
                    except BaseException as exc:  # wait for every send before re-raising
                        failure = failure or exc
                if failure is not None:
                    raise failure
        finally:
            for held_buffers in buffers:
                self._buffers.give(held_buffers)
        stored: list[bool] = []
        index = 0
        for held in present:
            if held:
                index += 1  # its PEXPIREAT
                stored.append(False)
            else:
                stored.append(bool(replies[index]))  # its SET NX
                index += 2
        return stored

    def close(self) -> None:
        """Stop the worker threads (a later write starts them again)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _prepare_group(
        self,
        group: list[int],
        keys: list[str],
        batch: list[Outgoing],
        present: list[bool],
    ) -> tuple[list[_Command], list[bytearray]]:
        """A command per block, with the pooled buffers the values live in. With a client from
        ``make_client`` a value is the header and the caller's payload buffer, sent without
        being copied."""
        commands: list[_Command] = []
        held_buffers: list[bytearray] = []
        client = self._link.client
        zero_copy = client is not None and sends_parts(client)
        for i in group:
            block_hash, view, namespace_root, parent, nbytes, expires_at, codec, raw = batch[i]
            ms = int(expires_at * 1000)
            if present[i]:
                commands.append((keys[i], ms, None))
                continue
            header = self._codec.encode(
                block_hash, namespace_root, parent, nbytes, payload_checksum(view), codec, raw
            )
            if zero_copy:
                commands.append((keys[i], ms, Parts(memoryview(header), view)))
                continue
            buf = self._buffers.take(HEADER_SIZE + nbytes)
            held_buffers.append(buf)
            value = memoryview(buf)
            value[:HEADER_SIZE] = header
            np.copyto(
                np.frombuffer(buf, dtype=np.uint8, offset=HEADER_SIZE),
                np.frombuffer(view, dtype=np.uint8),
            )
            commands.append((keys[i], ms, value))
        return commands, held_buffers

    def _send_group(self, commands: list[_Command]) -> list[Any]:
        def queue(p: Any) -> None:
            for key, ms, value in commands:
                if value is not None:
                    p.set(key, value, pxat=ms, nx=True)
                # A held block, or a racing writer got there first: keep the longest expiry.
                p.pexpireat(key, ms, gt=True)

        return self._link.pipeline(queue)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=_SEND_WORKERS, thread_name_prefix=f"{self._name}-send"
                )
            return self._pool
