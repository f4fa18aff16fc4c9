"""vLLM's KV event publisher, rebuilt for the tests: the msgspec structs with vLLM's field
order and struct options (``vllm/distributed/kv_events.py``), in the two encodings in the
wild, published the way ``ZmqEventPublisher`` does on real ZMQ sockets.

- ``legacy=True``: vLLM <= 0.23: every struct ``array_like=True, omit_defaults=True,
  tag=True`` (events are ``["BlockStored", ...]``), and the replay answers ``(seq, payload)``.
- ``legacy=False``: vLLM >= 0.24: events are maps with a ``"type"`` tag (the batch stays
  positional), new trailing fields, and the replay answers ``(topic, seq, payload)``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

# -- vLLM <= 0.23 -------------------------------------------------------------------------


class LegacyEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class LegacyKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LegacyBlockStored(LegacyKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class LegacyBlockRemoved(LegacyKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class LegacyAllBlocksCleared(LegacyKVCacheEvent, tag="AllBlocksCleared"):
    pass


# -- vLLM >= 0.24 -------------------------------------------------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class SomethingNew(KVCacheEvent):
    """An event type of a future version: consumers skip it."""

    detail: str


def stored(
    legacy: bool,
    hashes: list[int],
    parent: int | None,
    token_ids: list[int],
    block_size: int,
    *,
    medium: str | None = "GPU",
    lora_id: int | None = None,
    lora_name: str | None = None,
    extra_keys: list[tuple[Any, ...] | None] | None = None,
) -> Any:
    if legacy:
        assert extra_keys is None, "vLLM <= 0.23 sends no extra keys"
        return LegacyBlockStored(hashes, parent, token_ids, block_size, lora_id, medium, lora_name)
    return BlockStored(
        hashes, parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys
    )


def removed(legacy: bool, hashes: list[int], medium: str | None = "GPU") -> Any:
    return LegacyBlockRemoved(hashes, medium) if legacy else BlockRemoved(hashes, medium)


def cleared(legacy: bool) -> Any:
    return LegacyAllBlocksCleared() if legacy else AllBlocksCleared()


def batch(legacy: bool, events: list[Any]) -> Any:
    cls = LegacyEventBatch if legacy else EventBatch
    return cls(time.time(), events, 0)


class Publisher:
    """``ZmqEventPublisher``'s behaviour: a PUB (XPUB) socket bound at ``endpoint``, a ROUTER
    replay socket at ``replay_endpoint`` answering from a buffer of the last
    ``buffer_steps`` payloads, then seq -1; one thread owns both sockets. ``drop`` makes the
    next publishes reach the buffer but not the wire (a subscriber sees a gap)."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        *,
        legacy: bool,
        topic: str = "",
        buffer_steps: int = 10_000,
    ) -> None:
        self.legacy = legacy
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self._ctx = zmq.Context()
        # XPUB sends exactly what vLLM's PUB sends; it also hands the subscriptions up, so
        # that a test waits for the node's instead of sleeping (a PUB drops what it sends
        # before a subscription arrives)
        self._pub = self._ctx.socket(zmq.XPUB)
        self._subscribed = threading.Event()
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            # an open socket left to the collector hangs its context's term() in whichever
            # later test collects it
            self._ctx.destroy(linger=0)
            raise
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[tuple[Any, bool] | None] = queue.Queue()
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def wait_subscriber(self, timeout_s: float = 30.0) -> None:
        """Until a subscriber's subscription arrived."""
        if not self._subscribed.wait(timeout_s):
            raise TimeoutError("no subscriber")

    def publish(self, events: list[Any], *, send: bool = True) -> int:
        """Queue one batch; returns its seq. ``send=False``: buffered for replay only."""
        self._idle.clear()
        seq = self._seq
        self._seq += 1
        self._queue.put((batch(self.legacy, events), send))
        return seq

    def publish_raw(self, payload: bytes) -> int:
        self._idle.clear()
        seq = self._seq
        self._seq += 1
        self._queue.put((payload, True))
        return seq

    def flush(self) -> None:
        self._queue.join()

    def forget(self) -> None:
        """Empty the replay buffer (as if ``buffer_steps`` had passed)."""
        self.flush()
        self._buffer.clear()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._service_replay()
            while self._pub.poll(0):
                if self._pub.recv()[:1] == b"\x01":
                    self._subscribed.set()
            try:
                item = self._queue.get(timeout=0.01)
            except queue.Empty:
                continue
            if item is None:
                self._queue.task_done()
                return
            event, send = item
            payload = event if isinstance(event, bytes) else self._encoder.encode(event)
            if send:
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            seq += 1
            self._queue.task_done()

    def _service_replay(self) -> None:
        assert self._replay is not None
        frame = self._replay.recv_multipart()
        if len(frame) != 3:
            return
        client_id, _, start_bytes = frame
        start = int.from_bytes(start_bytes, "big")
        for seq, buf in list(self._buffer):
            if seq >= start:
                head = (client_id, b"") if self.legacy else (client_id, b"", self.topic)
                self._replay.send_multipart((*head, seq.to_bytes(8, "big"), buf))
        tail = (client_id, b"") if self.legacy else (client_id, b"", self.topic)
        self._replay.send_multipart((*tail, self.END_SEQ, b""))
