"""Finish reasons on the data plane, against a node in this process (its forecast read back):
a STORE or a STAGE of a session's request that says why the request finished files the
session's chain under the forecast that follows; a bad finish byte is refused and the
connection carries on."""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from sessioncache.clock import ManualClock
from sessioncache.config import Settings
from sessioncache.connector import StreamClient
from sessioncache.dataplane import frames
from sessioncache.dataplane.frames import HEADER_SIZE, Op, StoreHead
from sessioncache.errors import InvalidInput
from sessioncache.factory import open_node
from sessioncache.hashing import BlockHash
from sessioncache.node import OPEN_TENANT, CacheNode
from tests.sessioncache.dataplane.conftest import NS, pattern, tokens

SIZE = 4096


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def node(tmp_path: Path, clock: ManualClock) -> Iterator[CacheNode]:
    settings = Settings(  # keys as dates: the ``next_use`` order
        data_dir=tmp_path / "data", cpu_bytes=32 << 20, disk_bytes=0, eviction_policy="next_use"
    )
    node = open_node(settings, clock=clock, start=False)
    assert node.store.forecast is not None  # the default policy forecasts
    yield node
    node.close()


def next_use_after(
    node: CacheNode, client: StreamClient, seed: int, finish_reason: str | None
) -> float:
    """Seconds from now to the predicted next use of the head of a fresh session's chain,
    stored (4 blocks, in two STOREs or STAGEs) with ``finish_reason``."""
    session = node.sessions.open(tenant=OPEN_TENANT).id
    root = client.resolve(NS)
    toks = tokens(seed, 4)
    ids = client.block_hashes(root, toks)
    ack = client.store(
        root,
        toks,
        [pattern(h, SIZE) for h in ids],
        session_id=session,
        finish_reason=finish_reason,
    )
    assert ack.stored == 4
    assert node.sessions.get(session, tenant=OPEN_TENANT).head == BlockHash(ids[-1])
    meta = node.store.reads.meta(BlockHash(ids[-1]))
    assert meta is not None
    return meta.next_use - node.store.clock.now()


@pytest.mark.parametrize("carrier", ["stream", "samehost"])
def test_a_stored_finish_reason_sets_when_the_session_is_expected_back(
    node: CacheNode, carrier: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
):
    client: StreamClient = request.getfixturevalue(carrier)
    monkeypatch.setattr(client, "segment_bytes", 2 * SIZE)  # two requests, each with the reason
    forecast = node.store.forecast
    assert forecast is not None
    running = next_use_after(node, client, 1, None)
    tool = next_use_after(node, client, 2, "tool_use")
    done = next_use_after(node, client, 3, "end_turn")
    assert running == pytest.approx(forecast.in_flight_s)  # a request arrived, still running
    assert tool == pytest.approx(forecast.gaps["tool"])  # back with the tool's result
    assert done == pytest.approx(forecast.gaps["stop"])  # back when the user is
    assert tool < done


def test_a_bad_finish_byte_is_refused_and_the_connection_carries_on(
    node: CacheNode, stream: StreamClient
):
    session = node.sessions.open(tenant=OPEN_TENANT).id
    root = stream.resolve(NS)
    toks = tokens(4, 2)
    ids = stream.block_hashes(root, toks)
    head = StoreHead(root, None, NS.block_tokens, 2, SIZE, session_id=session)
    head = head._replace(finish_reason="stop")
    body = [memoryview(pattern(h, SIZE)) for h in ids]

    def bad_code(rid: int, code: int) -> bytes:
        frame = bytearray(frames.encode_store_head(rid, head, struct.pack("<8I", *toks)))
        at = HEADER_SIZE + frames.SESSION_LEN + len(session.encode()) + 52  # the finish byte
        assert frame[at] == frames.finish_code("stop")
        frame[at] = code
        return bytes(frame)

    for code in (0, len(frames.FINISH_REASONS) + 1):
        with pytest.raises(InvalidInput, match="finish reason code"):
            stream._c.call(Op.STORE, functools.partial(bad_code, code=code), payloads=body)
    assert node.store.reads.contains_many([BlockHash(h) for h in ids]) == [False, False]
    ack = stream.store(root, toks, body, session_id=session, finish_reason="stop")
    assert ack.stored == 2
    with pytest.raises(InvalidInput, match="session"):  # refused before anything is sent
        stream.store(root, toks, body, finish_reason="stop")
