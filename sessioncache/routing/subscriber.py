"""The engines' event feeds: one ZMQ SUB socket per engine, read by one thread.

Each engine binds a PUB socket (vLLM's ``--kv-events-config`` ``endpoint``) and, optionally, a
ROUTER replay socket (``replay_endpoint``); the node connects to both. Messages are
``(topic, seq, payload)``, ``seq`` counting from 0 per publisher. ``Sequencer`` (no I/O)
says what to do with each: apply it, fill a gap first from the replay socket, or start the
engine's view afresh (the engine restarted, the gap is wider than a replay holds, or the
replay cannot fill it: then the view is dropped and rebuilt from the events that follow).

The subscriber thread owns the SUB sockets and applies every message; the API only queues
commands to it and reads the index and the counters. A replay runs on a thread of its own,
on a socket of its own, one at a time per engine: meanwhile that engine's messages wait (at
most a replay buffer of them) and the other engines' flow on; the subscriber thread then
applies the answers and the messages that waited. Every (re)connect of an engine's SUB socket
asks its replay socket for what the engine published since the last message applied.
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
from zmq.utils.monitor import parse_monitor_message

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
"""The first redial of a dead endpoint; later ones back off to ``redial_max_s``."""
DRAIN = 256
"""Messages read from one socket before looking at the others and at the commands."""

Context = zmq.Context[zmq.Socket[bytes]]
Message = tuple[int, bytes]
"""``(seq, payload)``."""


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
    LOST = "lost"
    """A gap of ``reach`` messages or more: no replay holds them; drop the view, then apply."""


@dataclass(slots=True)
class Sequencer:
    """One engine's sequence numbers (no I/O). ``reach``: the most messages a replay can
    bring back (the engine's replay buffer)."""

    reach: int
    last_seq: int | None = None
    gaps: int = 0
    replays: int = 0
    views_dropped: int = 0
    restarts: int = 0

    @property
    def expected(self) -> int:
        return 0 if self.last_seq is None else self.last_seq + 1

    def classify(self, seq: int) -> Action:
        if self.last_seq is not None and seq <= self.last_seq:
            return Action.RESTART
        if seq == self.expected:
            return Action.APPLY
        return Action.LOST if seq - self.expected >= self.reach else Action.CATCH_UP

    def applied(self, seq: int) -> None:
        self.last_seq = seq


@dataclass(slots=True)
class _Replay:
    """A replay in flight: the messages from ``start`` up to ``until - 1`` (a gap), or as many
    as the engine holds (``until`` None: a (re)connect); ``held``: the engine's messages that
    arrived meanwhile, in order."""

    start: int
    until: int | None
    held: list[Message] = field(default_factory=list)


@dataclass(slots=True)
class _Feed:
    spec: EngineSpec
    registered_at: float
    seq: Sequencer
    last_message_at: float | None = None
    bad_messages: int = 0
    replay: _Replay | None = None
    """Set and cleared on the subscriber thread."""
    backlog: bool = False
    """The last read of the engine's socket stopped at ``DRAIN`` with messages left."""
    echo: tuple[int, int] | None = None
    """The seqs the last (re)connect's replay applied: the SUB socket may deliver them too."""
    connects: int = 0
    """Connects of the SUB socket seen (each asks the replay for what was missed)."""


@dataclass(frozen=True, slots=True)
class FeedStatus:
    spec: EngineSpec
    last_seq: int | None
    connects: int
    """Connects of the node's socket to the engine seen so far (0: never reached it)."""
    gaps: int
    replays: int
    views_dropped: int
    restarts: int
    bad_messages: int
    last_message_age_s: float | None
    behind: bool
    """The node has not applied all the engine sent: a replay pending, messages queued."""
    stale: bool
    """Silent longer than ``stale_s``, or behind."""


class EngineFeeds:
    """The registered engines, their SUB sockets and the thread reading them."""

    def __init__(
        self,
        index: EngineIndex,
        *,
        stale_s: float,
        replay_timeout_s: float = 2.0,
        replay_buffer: int = 10_000,
        redial_max_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.stale_s = stale_s
        self.replay_timeout_s = replay_timeout_s
        self.replay_buffer = replay_buffer
        self.redial_max_ms = max(1, round(redial_max_s * 1000))
        self._clock = clock
        self._feeds: dict[str, _Feed] = {}
        self._lock = threading.Lock()
        self._commands: queue.SimpleQueue[tuple[str, EngineSpec | str]] = queue.SimpleQueue()
        self._replayed: queue.SimpleQueue[tuple[_Feed, _Replay, list[Message]]] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._running = False

    # -- API side (any thread) -----------------------------------------------------------

    def add(self, spec: EngineSpec, root_for: RootFor, seed: int = 0) -> None:
        """Follow ``spec``'s events from now on; ``InvalidInput`` if its id is taken."""
        self.index.add(spec.engine_id, spec.namespace.block_tokens, root_for, seed)
        with self._lock:
            self._feeds[spec.engine_id] = _Feed(spec, self._clock(), Sequencer(self.replay_buffer))
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
            behind = f.replay is not None or f.backlog
            return FeedStatus(
                f.spec,
                s.last_seq,
                f.connects,
                s.gaps,
                s.replays,
                s.views_dropped,
                s.restarts,
                f.bad_messages,
                None if f.last_message_at is None else now - f.last_message_at,
                behind,
                behind or now - seen > self.stale_s,
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
        wire = _Wire(self.redial_max_ms)
        try:
            while self._running:
                self._commands_now(wire)
                self._replays_now(wire.ctx)
                if not wire.subs:
                    time.sleep(POLL_MS / 1000)
                    continue
                for sock, _ in wire.poller.poll(POLL_MS):
                    engine_id, monitor = wire.owners.get(sock, ("", False))
                    feed = self._feed(engine_id)
                    if feed is None:
                        continue
                    if monitor:
                        self._connections(wire.ctx, feed, sock)
                    else:
                        self._read(wire.ctx, feed, sock)
        except Exception:
            log.exception("the KV event subscriber stopped")
        finally:
            wire.close()

    def _feed(self, engine_id: str) -> _Feed | None:
        with self._lock:
            return self._feeds.get(engine_id)

    def _commands_now(self, wire: _Wire) -> None:
        while True:
            try:
                command, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "add" and isinstance(arg, EngineSpec):
                wire.open(arg)
            elif command == "remove" and isinstance(arg, str):
                wire.drop(arg)

    def _read(self, ctx: Context, feed: _Feed, sock: zmq.Socket[bytes]) -> None:
        for _ in range(DRAIN):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                feed.backlog = False
                return
            try:
                self._message(ctx, feed, frames)
            except Exception:  # one engine's odd message never stops the others
                log.exception("engine %s: a message could not be applied", feed.spec.engine_id)
                self.index.clear(feed.spec.engine_id)
        feed.backlog = True

    def _connections(self, ctx: Context, feed: _Feed, monitor: zmq.Socket[bytes]) -> None:
        """On every connect of the engine's SUB socket, ask its replay for what it missed."""
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] != zmq.EVENT_CONNECTED:
                continue
            feed.connects += 1
            if feed.spec.replay_endpoint is not None and feed.replay is None:
                self._ask(ctx, feed, _Replay(feed.seq.expected, None))

    def _message(self, ctx: Context, feed: _Feed, frames: list[bytes]) -> None:
        feed.last_message_at = self._clock()
        try:
            _, seq, payload = split_published(frames)
        except EventDecodeError as exc:
            feed.bad_messages += 1
            log.warning("engine %s: %s", feed.spec.engine_id, exc)
            return
        replay = feed.replay
        if replay is None:
            self._offer(ctx, feed, seq, payload)
        elif len(replay.held) < self.replay_buffer:
            replay.held.append((seq, payload))
        else:  # the engine ran further ahead than any replay holds: give this one up
            feed.replay = None
            self._drop_view(feed)
            self._apply(feed, seq, payload)

    def _offer(self, ctx: Context, feed: _Feed, seq: int, payload: bytes) -> None:
        """Sequence one message (no replay in flight for its engine)."""
        if feed.echo is not None:
            first, last = feed.echo
            if first <= seq <= last:
                return  # the (re)connect's replay applied it already
            feed.echo = None
        s = feed.seq
        action = s.classify(seq)
        if action is Action.RESTART:
            s.restarts += 1
            self.index.clear(feed.spec.engine_id)
        elif action is not Action.APPLY:
            if s.last_seq is not None:
                s.gaps += 1
            if action is Action.CATCH_UP and feed.spec.replay_endpoint is not None:
                s.replays += 1
                self._ask(ctx, feed, _Replay(s.expected, seq, [(seq, payload)]))
                return
            self._drop_view(feed)
        self._apply(feed, seq, payload)

    def _drop_view(self, feed: _Feed) -> None:
        """Events are lost for good: what the view says can no longer be trusted."""
        if feed.seq.last_seq is not None:
            feed.seq.views_dropped += 1
        self.index.clear(feed.spec.engine_id)

    def _apply(self, feed: _Feed, seq: int, payload: bytes) -> None:
        """Apply one message to the engine's view; its seq is counted once the view holds it,
        so that a reader who sees ``last_seq`` routes on it."""
        try:
            try:
                batch = decode_batch(payload)
            except EventDecodeError as exc:
                feed.bad_messages += 1
                feed.seq.views_dropped += 1
                self.index.clear(feed.spec.engine_id)
                log.warning("engine %s, seq %d: %s", feed.spec.engine_id, seq, exc)
                return
            self.index.apply(feed.spec.engine_id, batch)
        finally:
            feed.seq.applied(seq)

    # -- replays -------------------------------------------------------------------------

    def _ask(self, ctx: Context, feed: _Feed, replay: _Replay) -> None:
        """Start ``replay`` on a thread of its own; its answers come back to ``_settle``."""
        assert feed.spec.replay_endpoint is not None
        feed.replay = replay
        most = self.replay_buffer if replay.until is None else replay.until - replay.start
        endpoint = feed.spec.replay_endpoint

        def run() -> None:
            self._replayed.put((feed, replay, self._replay(ctx, endpoint, replay.start, most)))

        threading.Thread(target=run, name="sessioncache-kv-replay", daemon=True).start()

    def _replays_now(self, ctx: Context) -> None:
        while True:
            try:
                feed, replay, answers = self._replayed.get_nowait()
            except queue.Empty:
                return
            if feed.replay is not replay or self._feed(feed.spec.engine_id) is not feed:
                continue  # given up, or the engine removed
            feed.replay = None
            try:
                self._settle(ctx, feed, replay, answers)
            except Exception:
                log.exception("engine %s: a replay could not be applied", feed.spec.engine_id)
                self.index.clear(feed.spec.engine_id)

    def _settle(self, ctx: Context, feed: _Feed, replay: _Replay, answers: list[Message]) -> None:
        """Apply a replay's answers, then the messages that waited for it."""
        s = feed.seq
        if replay.until is None:
            if answers:
                s.replays += 1
                feed.echo = (answers[0][0], answers[-1][0])
        elif len(answers) < replay.until - replay.start:
            log.info(
                "engine %s: the replay cannot fill seq %d..%d",
                feed.spec.engine_id,
                replay.start,
                replay.until,
            )
            answers = []
            self._drop_view(feed)
            s.last_seq = replay.until - 1  # the view starts afresh at the message past the gap
        for seq, payload in answers:
            self._apply(feed, seq, payload)
        for seq, payload in replay.held:
            if feed.replay is not None:  # another gap: the rest waits for its replay
                feed.replay.held.append((seq, payload))
            else:
                self._offer(ctx, feed, seq, payload)

    def _replay(self, ctx: Context, endpoint: str, start: int, most: int) -> list[Message]:
        """Ask a vLLM replay ROUTER for the messages ``start, start + 1, ...``, at most
        ``most`` of them: it answers each message it holds from ``start``, then seq -1. The
        run ends early at an answer out of order (it no longer holds ``start``: nothing), and
        at the timeout. A DEALER's empty first frame stands for REQ's delimiter."""
        out: list[Message] = []
        try:
            sock = ctx.socket(zmq.DEALER)
        except zmq.ZMQError:  # the subscriber is closing
            return out
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"", encode_seq(start)])
            deadline = self._clock() + self.replay_timeout_s
            while len(out) < most:
                left_ms = int((deadline - self._clock()) * 1000)
                if left_ms <= 0 or not sock.poll(left_ms):
                    log.warning("replay from %s timed out", endpoint)
                    break
                seq, payload = split_replayed(sock.recv_multipart())
                if seq != start + len(out):
                    if seq != END_SEQ and not out:
                        log.info("replay from %s: seq %d is gone", endpoint, start)
                    break
                out.append((seq, payload))
        except EventDecodeError as exc:
            log.warning("replay from %s: %s", endpoint, exc)
        except zmq.ZMQError as exc:
            log.warning("replay from %s: %s", endpoint, exc)
        finally:
            sock.close(linger=0)
        return out


class _Wire:
    """The subscriber thread's sockets: per engine its SUB socket and a monitor of that
    socket's connections, all in one poller; ``owners``: each socket's engine, and whether
    it is the monitor."""

    def __init__(self, redial_max_ms: int) -> None:
        self.ctx: Context = zmq.Context()
        # set on every socket at its creation: a close after the context began terminating can
        # no longer set it, and a socket lingering on an unsent replay request blocks the end
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.poller = zmq.Poller()
        self.redial_max_ms = redial_max_ms
        self.subs: dict[str, zmq.Socket[bytes]] = {}
        self.monitors: dict[str, zmq.Socket[bytes]] = {}
        self.owners: dict[zmq.Socket[bytes], tuple[str, bool]] = {}

    def open(self, spec: EngineSpec) -> None:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
        sock.setsockopt(zmq.RCVHWM, 100_000)
        # a dead endpoint is redialled with backoff, not every 100 ms forever
        sock.setsockopt(zmq.RECONNECT_IVL, min(RECONNECT_MS, self.redial_max_ms))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, self.redial_max_ms)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
        try:
            sock.connect(spec.endpoint)
        except zmq.ZMQError as exc:
            log.warning("engine %s: cannot connect to %s: %s", spec.engine_id, spec.endpoint, exc)
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            return
        self.subs[spec.engine_id] = sock
        self.monitors[spec.engine_id] = monitor
        for s, is_monitor in ((sock, False), (monitor, True)):
            self.owners[s] = (spec.engine_id, is_monitor)
            self.poller.register(s, zmq.POLLIN)

    def drop(self, engine_id: str) -> None:
        sock = self.subs.pop(engine_id, None)
        monitor = self.monitors.pop(engine_id, None)
        if sock is None or monitor is None:
            return
        sock.disable_monitor()
        for s in (monitor, sock):
            self.poller.unregister(s)
            self.owners.pop(s, None)
            s.close(linger=0)

    def close(self) -> None:
        for engine_id in list(self.subs):
            self.drop(engine_id)
        self.ctx.term()
