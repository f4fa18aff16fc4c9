"""The sequencing rules of an engine's feed, and the feed's status while a replay is pending
(real ZMQ sockets; the API tests run the rest end to end)."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import zmq

from sessioncache.hashing import Namespace
from sessioncache.routing.engine_index import EngineIndex
from sessioncache.routing.events import EventBatch
from sessioncache.routing.subscriber import Action, EngineFeeds, EngineSpec, Sequencer
from tests.security.conftest import wait_until
from tests.support import vllm_events as ve
from tests.support.servers import free_port

NS = Namespace("feed-model", 16, "bf16", "x")


def test_sequence_numbers():
    s = Sequencer(reach=100)
    assert s.classify(0) is Action.APPLY
    assert s.classify(3) is Action.CATCH_UP and s.expected == 0  # joined late: replay from 0
    assert s.classify(100) is Action.LOST  # further back than any replay holds
    s.applied(0)
    assert s.classify(1) is Action.APPLY
    assert s.classify(5) is Action.CATCH_UP and s.expected == 1
    assert s.classify(100) is Action.CATCH_UP and s.classify(101) is Action.LOST
    assert s.classify(10**18) is Action.LOST
    s.applied(5)
    assert s.classify(5) is Action.RESTART  # the engine came back and counts from 0 again
    assert s.classify(0) is Action.RESTART
    assert s.classify(6) is Action.APPLY


class Engine:
    """A PUB socket sending the seqs a test picks, and a replay socket that never answers."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.spec = EngineSpec(
            f"e{free_port()}",
            NS,
            f"tcp://127.0.0.1:{free_port()}",
            f"tcp://127.0.0.1:{free_port()}",
        )
        self._pub = ctx.socket(zmq.XPUB)
        self._pub.bind(self.spec.endpoint)
        self._silent = ctx.socket(zmq.ROUTER)
        assert self.spec.replay_endpoint is not None
        self._silent.bind(self.spec.replay_endpoint)

    def wait_subscriber(self) -> None:
        assert self._pub.poll(10_000)
        self._pub.recv()

    def send(self, seq: int) -> None:
        stored = ve.stored(False, [seq], None, list(range(16)), 16)
        payload = msgspec.msgpack.encode(ve.batch(False, [stored]))
        self._pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))


@pytest.fixture
def zctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def feeds() -> Iterator[EngineFeeds]:
    f = EngineFeeds(EngineIndex(), stale_s=300, replay_timeout_s=1.0, replay_buffer=100)
    yield f
    f.close()


def follow(feeds: EngineFeeds, *engines: Engine) -> None:
    """Register ``engines`` and wait until the first message of each (seq 0) is applied and
    the replays their connects asked for have given up."""
    for engine in engines:
        feeds.add(engine.spec, lambda *_: NS.root(0))
    for engine in engines:
        engine.wait_subscriber()
        engine.send(0)
    for engine in engines:
        assert wait_until(lambda e=engine: last_seq(feeds, e) == 0, 5)
        assert wait_until(lambda e=engine: not feeds.stale(e.spec.engine_id), 5)


def last_seq(feeds: EngineFeeds, engine: Engine) -> int | None:
    status = feeds.status(engine.spec.engine_id)
    assert status is not None
    return status.last_seq


def test_a_gap_no_replay_holds_restarts_the_view_at_once(
    feeds: EngineFeeds, zctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    engine = Engine(zctx)
    follow(feeds, engine)
    engine.send(10**15)
    assert wait_until(lambda: last_seq(feeds, engine) == 10**15, 0.6)  # before any timeout
    status = feeds.status(engine.spec.engine_id)
    assert status is not None
    assert (status.gaps, status.replays, status.views_dropped) == (1, 0, 1)


def test_a_feed_is_behind_while_its_replay_is_pending_and_others_flow(
    feeds: EngineFeeds, zctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    gapped, other = Engine(zctx), Engine(zctx)
    follow(feeds, gapped, other)
    gapped.send(2)  # seq 1 is missing: its replay never answers
    gapped.send(3)
    assert wait_until(lambda: feeds.stale(gapped.spec.engine_id), 0.3)
    other.send(1)
    assert wait_until(lambda: last_seq(feeds, other) == 1, 0.3)  # not held up
    assert not feeds.stale(other.spec.engine_id)
    status = feeds.status(gapped.spec.engine_id)
    assert status is not None and status.behind and status.last_seq == 0
    assert wait_until(lambda: last_seq(feeds, gapped) == 3, 3)  # the replay gave up
    status = feeds.status(gapped.spec.engine_id)
    assert status is not None and not status.stale
    assert (status.gaps, status.replays, status.views_dropped) == (1, 1, 1)


class _Watching(EngineIndex):
    """The engine index, noting the feed's ``last_seq`` as each batch is applied."""

    def __init__(self) -> None:
        super().__init__()
        self.feeds: EngineFeeds | None = None
        self.seen: list[int | None] = []

    def apply(self, engine_id: str, batch: EventBatch) -> None:
        assert self.feeds is not None
        self.seen.append(self.feeds._feeds[engine_id].seq.last_seq)
        super().apply(engine_id, batch)


def test_a_message_is_counted_only_once_the_view_holds_it(
    zctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A reader that waits for ``last_seq`` (``GET /v1/engines/{id}``) and then routes must
    find the batch in the view."""
    index = _Watching()
    feeds = EngineFeeds(index, stale_s=300, replay_timeout_s=1.0, replay_buffer=100)
    index.feeds = feeds
    try:
        engine = Engine(zctx)
        follow(feeds, engine)
        engine.send(1)
        assert wait_until(lambda: last_seq(feeds, engine) == 1, 5)
        assert index.seen[-1] == 0  # seq 1 was not counted while it was being applied
    finally:
        feeds.close()
