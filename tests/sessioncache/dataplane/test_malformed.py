"""Frames that break the framing get an ERROR frame and a closed connection, never a
traceback; the node goes on serving every other connection."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

import pytest

from sessioncache.dataplane import frames
from sessioncache.dataplane.frames import Op
from sessioncache.errors import ErrorCode
from tests.sessioncache.dataplane.conftest import (
    NS,
    assert_closed,
    connect,
    raw_connect,
    raw_hello,
    read_frame,
    rest,
    settled,
    tokens,
    wait_until,
)
from tests.support.servers import Server


def bad_magic(sock: socket.socket) -> None:
    sock.sendall(b"HTTP" + frames.encode_header(Op.HELLO, 1, 0)[4:])


def oversized(sock: socket.socket) -> None:
    raw_hello(sock)
    sock.sendall(frames.encode_header(Op.LOOKUP, 2, 1 << 40))


def truncated(sock: socket.socket) -> None:
    raw_hello(sock)
    frame = frames.encode_resolve(2, NS)
    sock.sendall(frame[: len(frame) - 5])
    sock.shutdown(socket.SHUT_WR)  # the body never comes whole


def unknown_opcode(sock: socket.socket) -> None:
    raw_hello(sock)
    sock.sendall(struct.pack("<4sBBHQQ", b"SCDP", frames.VERSION, 0x42, 0, 2, 0))


def wrong_version(sock: socket.socket) -> None:
    sock.sendall(struct.pack("<4sBBHQQ", b"SCDP", 9, 1, 0, 1, 0))


def an_answer_as_a_request(sock: socket.socket) -> None:
    raw_hello(sock)
    sock.sendall(frames.encode_release_ok(2))


def store_lying_about_its_length(sock: socket.socket) -> None:
    raw_hello(sock)
    sock.sendall(frames.encode_resolve(2, NS))
    root = read_frame(sock)[1]
    head = frames.StoreHead(root, None, 4, 1, 1024)
    frame = frames.encode_store_head(3, head, bytes(16))
    sock.sendall(frame[:16] + struct.pack("<Q", head.body_len + 7) + frame[24:])


@pytest.mark.parametrize(
    ("send", "code"),
    [
        (bad_magic, ErrorCode.MALFORMED),
        (oversized, ErrorCode.MALFORMED),
        (truncated, ErrorCode.MALFORMED),
        (unknown_opcode, ErrorCode.MALFORMED),
        (an_answer_as_a_request, ErrorCode.MALFORMED),
        (store_lying_about_its_length, ErrorCode.MALFORMED),
    ],
)
def test_malformed_frames_get_an_error_and_a_closed_connection(
    open_server: Server, send: Callable[[socket.socket], None], code: ErrorCode
):
    with connect(open_server) as bystander, raw_connect(open_server) as sock:
        root = bystander.resolve(NS)
        send(sock)
        header, body = read_frame(sock)
        assert header.opcode == Op.ERROR
        error = frames.decode_error(body, header.flags)
        assert error.code == code and error.closing, error
        assert "Traceback" not in error.message
        assert_closed(sock)
        # the node serves the others as before
        ids = bystander.block_hashes(root, tokens(40, 2))
        assert bystander.lookup(root, ids).matched in (0, 2)
    wait_until(lambda: settled(open_server))


def test_requests_before_hello_are_refused(open_server: Server):
    with raw_connect(open_server) as sock:
        sock.sendall(frames.encode_resolve(1, NS))
        header, body = read_frame(sock)
        error = frames.decode_error(body, header.flags)
        assert (error.code, error.closing) == (ErrorCode.AUTH, True)
        assert "HELLO" in error.message
        assert_closed(sock)


def test_a_peer_that_leaves_between_frames_is_no_error(open_server: Server):
    with raw_connect(open_server) as sock:
        raw_hello(sock)
        sock.sendall(frames.encode_header(Op.RESOLVE, 2, 5)[:10])
    with raw_connect(open_server) as sock:
        pass
    wait_until(lambda: settled(open_server))
    assert rest(open_server, "/healthz")["status"] == "ok"
