"""The engines' event feeds: one ZMQ SUB socket per engine, read by one thread.

Each engine binds a PUB socket (vLLM's ``--kv-events-config`` ``endpoint``) and, optionally, a
ROUTER replay socket (``replay_endpoint``); the node connects to both. Messages are
``(topic, seq, payload)``, ``seq`` counting from 0 per publisher. ``Sequencer`` (no I/O)
says what to do with each: apply it, fill a gap first from the replay socket, or start the
engine's view afresh (the engine restarted, or the replay cannot reach back far enough: then
the view is dropped and rebuilt from the events that follow).

All socket I/O runs on the subscriber thread (ZMQ sockets are not thread-safe); the API only
queues commands to it and reads the index and the counters.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import zmq

from sessioncache.errors import EventDecodeError
from sessioncache.hashing import Namespace
from sessioncache.routing.engine_index import EngineIndex, RootFor
from sessioncache.routing.events import (
    END_SEQ,
    decode_batch,
    encode_seq,
    split_published,
    split_replayed,
)

log = logging.getLogger("sessioncache.routing")

POLL_MS = 50
RECONNECT_MS = 1000
RECONNECT_MAX_MS = 30_000
DRAIN = 256
"""Messages read from one socket before looking at the others and at the commands."""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """An engine whose events the node follows. ``namespace`` gives its block size (and the
    model, KV dtype and layout every id of it is rooted in); ``tenant`` None: shared, every
    tenant may route to it (registered in the settings only)."""

    engine_id: str
    namespace: Namespace
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    tenant: str | None = None


class Action(Enum):
    APPLY = "apply"
    CATCH_UP = "catch_up"
    """A gap (or a first message past 0): replay from ``Sequencer.expected`` first."""
    RESTART = "restart"
    """The sequence went back: the engine restarted; drop its view, then apply."""


@dataclass(slots=True)
class Sequencer:
    """One engine's sequence numbers (no I/O)."""

    last_seq: int | None = None
    gaps: int = 0
    replays: int = 0
    views_dropped: int = 0
    restarts: int = 0

    @property
    def expected(self) -> int:
        return 0 if self.last_seq is None else self.last_seq + 1

    def classify(self, seq: int) -> Action:
        if self.last_seq is None:
            return Action.APPLY if seq == 0 else Action.CATCH_UP
        if seq <= self.last_seq:
            return Action.RESTART
        return Action.APPLY if seq == self.last_seq + 1 else Action.CATCH_UP

    def applied(self, seq: int) -> None:
        self.last_seq = seq


@dataclass(slots=True)
class _Feed:
    spec: EngineSpec
    registered_at: float
    seq: Sequencer = field(default_factory=Sequencer)
    last_message_at: float | None = None
    bad_messages: int = 0


@dataclass(frozen=True, slots=True)
class FeedStatus:
    spec: EngineSpec
    last_seq: int | None
    gaps: int
    replays: int
    views_dropped: int
    restarts: int
    bad_messages: int
    last_message_age_s: float | None
    stale: bool


class EngineFeeds:
    """The registered engines, their SUB sockets and the thread reading them."""

    def __init__(
        self,
        index: EngineIndex,
        *,
        stale_s: float,
        replay_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.stale_s = stale_s
        self.replay_timeout_s = replay_timeout_s
        self._clock = clock
        self._feeds: dict[str, _Feed] = {}
        self._lock = threading.Lock()
        self._commands: queue.SimpleQueue[tuple[str, EngineSpec | str]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._running = False

    # -- API side (any thread) -----------------------------------------------------------

    def add(self, spec: EngineSpec, root_for: RootFor, seed: int = 0) -> None:
        """Follow ``spec``'s events from now on; ``InvalidInput`` if its id is taken."""
        self.index.add(spec.engine_id, spec.namespace.block_tokens, root_for, seed)
        with self._lock:
            self._feeds[spec.engine_id] = _Feed(spec, self._clock())
        self._commands.put(("add", spec))
        self._ensure_thread()

    def remove(self, engine_id: str) -> bool:
        with self._lock:
            feed = self._feeds.pop(engine_id, None)
        if feed is None:
            return False
        self._commands.put(("remove", engine_id))
        self.index.remove(engine_id)
        return True

    def spec(self, engine_id: str) -> EngineSpec | None:
        with self._lock:
            feed = self._feeds.get(engine_id)
            return None if feed is None else feed.spec

    def specs(self) -> list[EngineSpec]:
        with self._lock:
            return [f.spec for f in self._feeds.values()]

    def status(self, engine_id: str) -> FeedStatus | None:
        now = self._clock()
        with self._lock:
            f = self._feeds.get(engine_id)
            if f is None:
                return None
            seen = f.last_message_at if f.last_message_at is not None else f.registered_at
            s = f.seq
            return FeedStatus(
                f.spec,
                s.last_seq,
                s.gaps,
                s.replays,
                s.views_dropped,
                s.restarts,
                f.bad_messages,
                None if f.last_message_at is None else now - f.last_message_at,
                now - seen > self.stale_s,
            )

    def stale(self, engine_id: str) -> bool:
        status = self.status(engine_id)
        return status is None or status.stale

    def close(self) -> None:
        self._running = False
        thread = self._thread
        if thread is not None:
            thread.join(timeout=5)
        self._thread = None

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._running = True
            self._thread = threading.Thread(
                target=self._run, name="sessioncache-kv-events", daemon=True
            )
            self._thread.start()

    # -- the subscriber thread -----------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context()
        poller = zmq.Poller()
        sockets: dict[str, zmq.Socket[bytes]] = {}
        owners: dict[zmq.Socket[bytes], str] = {}
        try:
            while self._running:
                self._commands_now(ctx, poller, sockets, owners)
                for sock, _ in poller.poll(POLL_MS) if sockets else []:
                    engine_id = owners.get(sock)
                    if engine_id is None:
                        continue
                    for _ in range(DRAIN):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            self._message(ctx, engine_id, frames)
                        except Exception:  # one engine's odd message never stops the others
                            log.exception("engine %s: a message could not be applied", engine_id)
                            self.index.clear(engine_id)
                if not sockets:
                    time.sleep(POLL_MS / 1000)
        except Exception:
            log.exception("the KV event subscriber stopped")
        finally:
            for sock in sockets.values():
                sock.close(linger=0)
            ctx.term()

    def _commands_now(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        poller: zmq.Poller,
        sockets: dict[str, zmq.Socket[bytes]],
        owners: dict[zmq.Socket[bytes], str],
    ) -> None:
        while True:
            try:
                command, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "add" and isinstance(arg, EngineSpec):
                sock = ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.SUBSCRIBE, arg.topic.encode())
                sock.setsockopt(zmq.RCVHWM, 100_000)
                # a dead endpoint is redialled with backoff, not every 100 ms forever
                sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
                sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
                try:
                    sock.connect(arg.endpoint)
                except zmq.ZMQError as exc:
                    log.warning(
                        "engine %s: cannot connect to %s: %s", arg.engine_id, arg.endpoint, exc
                    )
                    sock.close(linger=0)
                    continue
                sockets[arg.engine_id] = sock
                owners[sock] = arg.engine_id
                poller.register(sock, zmq.POLLIN)
            elif command == "remove" and isinstance(arg, str):
                old = sockets.pop(arg, None)
                if old is not None:
                    poller.unregister(old)
                    owners.pop(old, None)
                    old.close(linger=0)

    def _message(
        self, ctx: zmq.Context[zmq.Socket[bytes]], engine_id: str, frames: list[bytes]
    ) -> None:
        with self._lock:
            feed = self._feeds.get(engine_id)
        if feed is None:
            return
        feed.last_message_at = self._clock()
        try:
            _, seq, payload = split_published(frames)
        except EventDecodeError as exc:
            feed.bad_messages += 1
            log.warning("engine %s: %s", engine_id, exc)
            return
        sequencer = feed.seq
        action = sequencer.classify(seq)
        if action is Action.RESTART:
            sequencer.restarts += 1
            self.index.clear(engine_id)
        elif action is Action.CATCH_UP:
            first = sequencer.last_seq is None
            if not first:
                sequencer.gaps += 1
            if not self._catch_up(ctx, feed, sequencer.expected, seq) and not first:
                # events are lost for good: what the view says can no longer be trusted
                sequencer.views_dropped += 1
                self.index.clear(engine_id)
        self._apply(feed, seq, payload)

    def _apply(self, feed: _Feed, seq: int, payload: bytes) -> None:
        feed.seq.applied(seq)
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            feed.bad_messages += 1
            feed.seq.views_dropped += 1
            self.index.clear(feed.spec.engine_id)
            log.warning("engine %s, seq %d: %s", feed.spec.engine_id, seq, exc)
            return
        self.index.apply(feed.spec.engine_id, batch)

    def _catch_up(
        self, ctx: zmq.Context[zmq.Socket[bytes]], feed: _Feed, start: int, until: int
    ) -> bool:
        """Apply the messages ``start .. until - 1`` from the engine's replay socket; False
        (nothing applied) when it has none, does not answer, or no longer holds ``start``."""
        endpoint = feed.spec.replay_endpoint
        if endpoint is None:
            return False
        feed.seq.replays += 1
        answers = self._replay(ctx, endpoint, start)
        wanted = [(s, p) for s, p in answers if start <= s < until]
        if [s for s, _ in wanted] != list(range(start, until)):
            log.info(
                "engine %s: the replay cannot fill seq %d..%d", feed.spec.engine_id, start, until
            )
            return False
        for s, payload in wanted:
            self._apply(feed, s, payload)
        return True

    def _replay(
        self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int
    ) -> list[tuple[int, bytes]]:
        """Ask a vLLM replay ROUTER for everything from ``start``: it answers each buffered
        message, then seq -1. A DEALER's empty first frame stands for REQ's delimiter."""
        sock = ctx.socket(zmq.DEALER)
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"", encode_seq(start)])
            deadline = self._clock() + self.replay_timeout_s
            while True:
                left_ms = int((deadline - self._clock()) * 1000)
                if left_ms <= 0 or not sock.poll(left_ms):
                    log.warning("replay from %s timed out", endpoint)
                    return []
                try:
                    seq, payload = split_replayed(sock.recv_multipart())
                except EventDecodeError as exc:
                    log.warning("replay from %s: %s", endpoint, exc)
                    return []
                if seq == END_SEQ:
                    return out
                out.append((seq, payload))
        finally:
            sock.close(linger=0)
