"""Frame versions (docs/dataplane.md, "Versions"): negotiated in HELLO, a peer of an unknown
version refused with an ERROR it can read; the session section and the miss section."""

from __future__ import annotations

import socket
import struct

import pytest

from sessioncache.dataplane import frames
from sessioncache.dataplane.frames import HEADER_SIZE, Op
from sessioncache.errors import ErrorCode, FrameError, InvalidInput
from tests.sessioncache.dataplane.conftest import (
    Server,
    assert_closed,
    raw_connect,
    raw_hello,
    read_exactly,
)


def read_any_version(sock: socket.socket) -> tuple[int, int, int, bytes]:
    """(version, opcode, flags, body) of the next frame, whatever its version."""
    magic, version, opcode, flags, _, body_len = frames.HEADER.unpack(
        read_exactly(sock, HEADER_SIZE)
    )
    assert magic == frames.MAGIC
    return version, opcode, flags, read_exactly(sock, body_len)


def test_a_client_of_an_older_version_reads_why_it_is_refused(open_server: Server):
    with raw_connect(open_server) as sock:
        body = b'{"api_key":null,"client":"old"}'
        sock.sendall(struct.pack("<4sBBHQQ", b"SCDP", 1, Op.HELLO, 0, 1, len(body)) + body)
        version, opcode, flags, reply = read_any_version(sock)
        # answered in the client's own version: an ERROR's layout is the same in all of them
        assert (version, opcode) == (1, Op.ERROR)
        error = frames.decode_error(reply, flags)
        assert error.code == ErrorCode.MALFORMED and error.closing
        assert "frame version 1" in error.message and "speaks version 2" in error.message
        assert_closed(sock)


def test_hello_negotiates_the_version(open_server: Server):
    with raw_connect(open_server) as sock:
        assert raw_hello(sock).version == frames.VERSION
    with raw_connect(open_server) as sock:
        sock.sendall(frames.encode_hello(1, frames.Hello(None, "future", (7, 8))))
        version, opcode, flags, reply = read_any_version(sock)
        assert (version, opcode) == (frames.FRAME_VERSION, Op.ERROR)
        error = frames.decode_error(reply, flags)
        assert error.closing and "frame version 8" in error.message
        assert_closed(sock)


def test_negotiate_takes_the_highest_common_version():
    assert frames.negotiate(frames.Hello(None, "x", (1, frames.VERSION, 99))) == frames.VERSION
    with pytest.raises(FrameError, match="frame version 99"):
        frames.negotiate(frames.Hello(None, "x", (99,)))


def test_the_session_section_starts_the_body():
    plain = frames.encode_lookup(5, frames.Lookup(b"r" * 16, [b"i" * 16], 100))
    named = frames.encode_lookup(5, frames.Lookup(b"r" * 16, [b"i" * 16], 100, session_id="s-1"))
    head = frames.decode_header(named[:HEADER_SIZE], requests=True)
    assert head.flags & frames.F_SESSION
    assert named[HEADER_SIZE:] == struct.pack("<H", 3) + b"s-1" + plain[HEADER_SIZE:]
    assert head.body_len == len(plain) - HEADER_SIZE + 5
    frames.check_body(head, frames.Limits())
    # a STORE's payloads are counted in its body_len, after the section and the head
    store = frames.StoreHead(b"r" * 16, None, 4, 2, 10, session_id="s-1")
    frame = frames.encode_store_head(1, store, bytes(32))
    header = frames.decode_header(frame[:HEADER_SIZE], requests=True)
    assert header.body_len == 5 + store.body_len == len(frame) - HEADER_SIZE + 20
    with pytest.raises(InvalidInput, match="session id"):
        frames.session_section("x" * 600)


def test_the_miss_section_round_trips():
    miss = frames.Miss(1, 3, 48, None, 2, 12.5, 0, (0, 32, 0, 16))
    ok = frames.LookupOk(None, 0, [10] * 3, [0] * 3, miss)
    frame = frames.encode_lookup_ok(1, ok)
    assert frames.decode_lookup_ok(frame[HEADER_SIZE:]) == ok
    none = frames.Miss(None, None, None, None, None, None, None, (0, 0, 0, 0))
    ok = frames.LookupOk(None, 0, [], [], none)
    assert frames.decode_lookup_ok(frames.encode_lookup_ok(1, ok)[HEADER_SIZE:]) == ok
