"""Every block status, decoded by every client that can meet it, against a real node: the REST,
stream and same-host clients (and ``KVTransfer`` over each path) report ``stored``,
``present`` and ``dropped`` (a block no tier has room for) the same way, and the same-host
client reports ``rejected`` for a slot whose checksum does not match. The codec carries every
status and refuses an unknown code."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from sessioncache.connector import (
    BlockStatus,
    NoRoom,
    SameHostClient,
    SessionCacheClient,
    StreamClient,
    protocol,
)
from sessioncache.connector import samehost as samehost_client
from sessioncache.connector.transfer import KVTransfer
from sessioncache.dataplane import frames
from sessioncache.dataplane.frames import Slot, StageOk, StoreOk
from sessioncache.errors import FrameError
from sessioncache.hashing import Namespace
from tests.support.servers import Server, start_server

BT = 16
SMALL = 4096
HUGE = 1 << 20
"""Larger than every tier of the node below: a block of this size is dropped."""

S, P, D, R = BlockStatus.STORED, BlockStatus.PRESENT, BlockStatus.DROPPED, BlockStatus.REJECTED


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("block-status") / "data",
        {"SESSIONCACHE_CPU_BYTES": str(512 << 10), "SESSIONCACHE_DISK_BYTES": str(512 << 10)},
    )
    yield server
    server.stop()


def rest(server: Server, model: str) -> SessionCacheClient:
    return SessionCacheClient(server.url, namespace=Namespace(model, BT, "bf16", "x"))


def tokens(seed: int, blocks: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, BT * blocks)]


def payloads(seed: int, n: int, size: int = SMALL) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def data_client(server: Server, path: str) -> StreamClient:
    if path == "same_host":
        return SameHostClient.discover(server.url)
    return StreamClient.discover(server.url)


@pytest.mark.parametrize("status", list(BlockStatus))
def test_the_codec_carries_every_status(status: BlockStatus) -> None:
    ids = [bytes([i]) * 16 for i in range(3)]
    ok = StoreOk(True, ids, [status, S, status])
    for encode, decode in (
        (frames.encode_store_ok, frames.decode_store_ok),
        (frames.encode_commit_ok, frames.decode_commit_ok),
    ):
        frame = encode(7, ok)
        assert decode(frame[frames.HEADER_SIZE :]) == ok
    slot = Slot(0, 0, 64)
    staged = StageOk(b"s" * 16, False, ids[:1], [status], [slot if status is S else None])
    frame = frames.encode_stage_ok(7, staged)
    assert frames.decode_stage_ok(frame[frames.HEADER_SIZE :], 64) == staged


def test_an_unknown_status_code_is_a_frame_error() -> None:
    frame = bytearray(frames.encode_store_ok(7, StoreOk(False, [b"i" * 16], [S])))
    frame[-1] = 9
    with pytest.raises(FrameError, match="unknown block status"):
        frames.decode_store_ok(bytes(frame[frames.HEADER_SIZE :]))


def test_rest_client_stored_present_dropped(node: Server) -> None:
    with rest(node, "rest-status") as client:
        toks, data = tokens(1, 3), payloads(1, 3)
        first = client.store(toks, [bytes(p) for p in data])
        assert first.status == [S, S, S] and first.kept == 3 and first.stored == 3
        again = client.store(toks, [bytes(p) for p in data])
        assert again.status == [P, P, P] and again.kept == 3 and again.stored == 0
    with rest(node, "rest-status-huge") as client:
        huge = client.store(tokens(2, 2), [bytes(p) for p in payloads(2, 2, HUGE)])
        # the first upload is answered 507 NoRoom; the second hangs off it and is not sent
        assert huge.status == [D, D] and huge.kept == 0 and not huge.durable
        # the upload itself is answered 507, never a 200 for a block the node does not hold
        with pytest.raises(NoRoom) as info:
            client._send(protocol.upload_request(huge.hashes[0], bytes(HUGE)))
        assert info.value.status == 507


@pytest.mark.parametrize("path", ["stream", "same_host"])
def test_data_plane_clients_stored_present_dropped(node: Server, path: str) -> None:
    with data_client(node, path) as client:
        root = client.resolve(Namespace(f"{path}-status", BT, "bf16", "x"))
        toks, data = tokens(4, 3), payloads(4, 3)
        assert client.store(root, toks, data).status == [S, S, S]
        ack = client.store(root, toks, data)
        assert ack.status == [P, P, P] and ack.kept == 3 and ack.held == [True] * 3
        huge_root = client.resolve(Namespace(f"{path}-status-huge", BT, "bf16", "x"))
        ack = client.store(huge_root, tokens(5, 2), payloads(5, 2, HUGE))
        assert ack.status == [D, D] and ack.kept == 0 and ack.held == [False, False]


def test_same_host_client_decodes_rejected(node: Server, monkeypatch: Any) -> None:
    """A writer whose checksum does not match its slot: the node rejects the block and drops
    the ones after it; the client reports both, and ``KVTransfer`` counts none of them kept."""
    real = samehost_client._copy_and_hash
    calls = {"n": 0}

    def wrong_second(dst: Any, payload: Any) -> int:
        calls["n"] += 1
        good = real(dst, payload)
        return good ^ 1 if calls["n"] == 2 else good

    monkeypatch.setattr(samehost_client, "_copy_and_hash", wrong_second)
    with SameHostClient.discover(node.url) as client:
        client.hash_ahead = False  # checksums taken while copying: the patched function
        root = client.resolve(Namespace("rejected-status", BT, "bf16", "x"))
        ack = client.store(root, tokens(6, 4), payloads(6, 4))
        assert ack.status == [S, R, D, D] and ack.kept == 1 and ack.held == [True] + [False] * 3
        assert client.exists(root, ack.hashes) == [True, False, False, False]


@pytest.mark.parametrize("path", ["rest", "stream", "same_host"])
def test_kv_transfer_counts_only_what_the_node_keeps(node: Server, path: str) -> None:
    with rest(node, f"transfer-status-{path}") as client, KVTransfer(client, path=path) as kv:
        toks = tokens(7, 2)
        assert kv.store_from(toks, payloads(7, 2)).blocks == 2
        assert kv.store_from(toks, payloads(7, 2)).blocks == 2  # present: still kept
    with rest(node, f"transfer-huge-{path}") as client, KVTransfer(client, path=path) as kv:
        assert kv.store_from(tokens(8, 2), payloads(8, 2, HUGE)).blocks == 0
