"""The frame codec on its own: every frame round-trips, and every way to break the framing is
refused before a byte of body is read."""

from __future__ import annotations

import struct

import pytest

from sessioncache.dataplane import frames
from sessioncache.dataplane.frames import (
    HEADER_SIZE,
    Header,
    Hello,
    HelloOk,
    Limits,
    LoadIds,
    LoadLease,
    Lookup,
    LookupOk,
    Op,
    StoreHead,
    StoreOk,
)
from sessioncache.errors import (
    AuthRefused,
    BlockNotFound,
    ErrorCode,
    FrameError,
    InvalidInput,
    LeaseNotFound,
    PayloadSizeError,
    RemoteError,
    StoreRefused,
    from_stream,
    stream_code,
)
from sessioncache.hashing import Namespace
from sessioncache.status import BlockStatus

LIMITS = Limits(max_ids=64, max_block_bytes=1 << 20, max_tokens=4096)
IDS = [bytes([i]) * 16 for i in range(5)]
ROOT = b"r" * 16


def split(frame: bytes, *, requests: bool) -> tuple[Header, bytes]:
    header = frames.decode_header(frame[:HEADER_SIZE], requests=requests)
    frames.check_body(header, LIMITS)
    body = frame[HEADER_SIZE:]
    assert header.body_len == len(body)
    return header, body


def test_header_layout_is_the_documented_one():
    frame = frames.encode_header(Op.LOOKUP, 0x0102030405060708, 42, flags=3)
    assert len(frame) == HEADER_SIZE == 24
    assert frame[:4] == b"SCDP"
    assert struct.unpack("<BBHQQ", frame[4:]) == (2, 0x03, 3, 0x0102030405060708, 42)


def test_hello_resolve_and_release_round_trip():
    header, body = split(frames.encode_hello(7, Hello("key", "me")), requests=True)
    assert header.opcode == Op.HELLO and header.request_id == 7
    assert frames.decode_hello(body) == Hello("key", "me")
    assert frames.decode_hello(split(frames.encode_hello(1, Hello(None)), requests=True)[1]) == (
        Hello(None, "")
    )

    ok = HelloOk("acme", True, ("cpu", "disk"), LIMITS)
    _, body = split(frames.encode_hello_ok(7, ok), requests=False)
    assert frames.decode_hello_ok(body) == ok

    ns = Namespace("m", 16, "bf16", "x", salt="s")
    _, body = split(frames.encode_resolve(2, ns), requests=True)
    assert frames.decode_resolve(body) == ns
    _, body = split(frames.encode_resolve_ok(2, ROOT), requests=False)
    assert frames.decode_resolve_ok(body) == ROOT

    _, body = split(frames.encode_release(3, IDS[1]), requests=True)
    assert frames.decode_release(body) == IDS[1]
    header, body = split(frames.encode_release_ok(3), requests=False)
    assert header.opcode == Op.RELEASE_OK and body == b""


def test_lookup_and_load_round_trip():
    _, body = split(frames.encode_lookup(1, Lookup(ROOT, IDS, 2500)), requests=True)
    assert frames.decode_lookup(body, LIMITS) == Lookup(ROOT, IDS, 2500)

    ok = LookupOk(b"L" * 16, 2500, [4096, 4096, 8], [0, 1, 255])
    _, body = split(frames.encode_lookup_ok(1, ok), requests=False)
    assert frames.decode_lookup_ok(body) == ok
    _, body = split(frames.encode_lookup_ok(1, LookupOk(None, 0, [], [])), requests=False)
    assert frames.decode_lookup_ok(body) == LookupOk(None, 0, [], [])

    for load in (LoadLease(b"L" * 16, 2, 3, True), LoadLease(b"L" * 16, 0, 1), LoadIds(IDS)):
        header, body = split(frames.encode_load(1, load), requests=True)
        assert frames.decode_load(body, header.flags, LIMITS) == load

    header = frames.decode_header(frames.block_header(9, 0, missing=True), requests=False)
    assert header == Header(Op.BLOCK, frames.F_BLOCK_MISSING, 9, 0)


def test_store_round_trip():
    tokens = struct.pack("<8I", *range(8))
    for parent in (None, IDS[0]):
        head = StoreHead(ROOT, parent, 4, 2, 100, 1500)
        frame = frames.encode_store_head(5, head, tokens)
        header = frames.decode_header(frame[:HEADER_SIZE], requests=True)
        frames.check_body(header, LIMITS)
        assert header.body_len == frames.STORE_FIXED + 32 + 200
        fixed = frame[HEADER_SIZE : HEADER_SIZE + frames.STORE_FIXED]
        assert frames.decode_store_head(fixed, header, LIMITS) == head
        assert frame[HEADER_SIZE + frames.STORE_FIXED :] == tokens

    ok = StoreOk(True, IDS[:3], [BlockStatus.STORED, BlockStatus.PRESENT, BlockStatus.DROPPED])
    _, body = split(frames.encode_store_ok(5, ok), requests=False)
    assert frames.decode_store_ok(body) == ok


def test_error_round_trip_and_codes():
    frame = frames.encode_error(4, frames.ErrorFrame(ErrorCode.REFUSED, "no é" * 2000, True))
    header, body = split(frame, requests=False)
    error = frames.decode_error(body, header.flags)
    assert error.code == ErrorCode.REFUSED and error.closing
    assert len(error.message.encode()) <= frames.MAX_MESSAGE

    cases: list[tuple[Exception, type[Exception]]] = [
        (FrameError("x"), FrameError),
        (PayloadSizeError("x"), PayloadSizeError),
        (InvalidInput("x"), InvalidInput),
        (AuthRefused("x"), AuthRefused),
        (BlockNotFound("x"), BlockNotFound),
        (LeaseNotFound("x"), LeaseNotFound),
        (StoreRefused("x"), StoreRefused),
        (RuntimeError("x"), RemoteError),
    ]
    for exc, cls in cases:
        raised = from_stream(stream_code(exc), "msg")
        assert type(raised) is cls, (exc, raised)
        assert str(raised) == "msg"
    assert isinstance(from_stream(999, "msg"), RemoteError)


@pytest.mark.parametrize(
    ("frame", "requests", "match"),
    [
        (b"XXXX" + frames.encode_header(Op.HELLO, 1, 0)[4:], True, "bad magic"),
        (struct.pack("<4sBBHQQ", b"SCDP", 1, 1, 0, 1, 0), True, "version 1; this end speaks"),
        (struct.pack("<4sBBHQQ", b"SCDP", 2, 0x42, 0, 1, 0), True, "unknown opcode"),
        (frames.encode_header(Op.HELLO_OK, 1, 0), True, "not a request"),
        (frames.encode_header(Op.LOOKUP, 1, 0), False, "not an answer"),
        (frames.encode_header(Op.HELLO, 1, 0)[:20], True, "24 bytes"),
    ],
)
def test_broken_headers_are_refused(frame: bytes, requests: bool, match: str):
    with pytest.raises(FrameError, match=match):
        frames.decode_header(frame, requests=requests)


@pytest.mark.parametrize(
    ("opcode", "flags", "body_len"),
    [
        (Op.HELLO, 0, LIMITS.max_json + 1),
        (Op.LOOKUP, 0, 24 + 16 * 64 + 1),
        (Op.LOAD, frames.F_LOAD_BY_LEASE, 25),
        (Op.LOAD, 0, 4 + 16 * 64 + 1),
        (Op.RELEASE, 0, 17),
        (Op.STORE, 0, 1 << 62),
    ],
)
def test_oversized_bodies_are_refused_from_the_header(opcode: Op, flags: int, body_len: int):
    header = frames.decode_header(frames.encode_header(opcode, 1, body_len, flags), requests=True)
    with pytest.raises(FrameError, match="exceeds the limit"):
        frames.check_body(header, LIMITS)


def test_bodies_that_disagree_with_their_counts():
    body = frames.encode_lookup(1, Lookup(ROOT, IDS))[HEADER_SIZE:]
    with pytest.raises(FrameError, match="expected 5 ids"):
        frames.decode_lookup(body[:-1], LIMITS)
    with pytest.raises(InvalidInput, match="1 to 64"):
        frames.decode_lookup(frames.encode_lookup(1, Lookup(ROOT, []))[HEADER_SIZE:], LIMITS)
    with pytest.raises(FrameError, match="not JSON"):
        frames.decode_hello(b"\xff{")
    with pytest.raises(InvalidInput, match="unknown namespace fields"):
        frames.decode_resolve(b'{"model": "m", "block_tokens": 4, "kv_dtype": "x", "oops": 1}')
    with pytest.raises(InvalidInput, match="block_tokens must be within"):
        frames.decode_resolve(
            b'{"model": "m", "block_tokens": 0, "kv_dtype": "x", "kv_layout": "y"}'
        )

    head = StoreHead(ROOT, None, 4, 2, 100)
    frame = frames.encode_store_head(1, head, bytes(32))
    fixed = frame[HEADER_SIZE : HEADER_SIZE + frames.STORE_FIXED]
    lying = frames.decode_header(
        frames.encode_header(Op.STORE, 1, head.body_len - 1), requests=True
    )
    with pytest.raises(FrameError, match="its head describes"):
        frames.decode_store_head(fixed, lying, LIMITS)
    big = StoreHead(ROOT, None, 4, 2, 2 << 20)
    frame = frames.encode_store_head(1, big, bytes(32))
    header = frames.decode_header(frame[:HEADER_SIZE], requests=True)
    with pytest.raises(InvalidInput, match="a block is 1 to"):
        frames.decode_store_head(
            frame[HEADER_SIZE : HEADER_SIZE + frames.STORE_FIXED], header, LIMITS
        )


def session_stripped(frame: bytes) -> tuple[Header, str, bytes]:
    """A STORE's header (``body_len``: what follows the session section, as the node passes
    it on), its session and the rest of its frame."""
    header = frames.decode_header(frame[:HEADER_SIZE], requests=True)
    frames.check_body(header, LIMITS)
    body = frame[HEADER_SIZE:]  # the payloads are not in the frame: the caller sends them
    n = frames.session_len(body[: frames.SESSION_LEN])
    session = frames.decode_session(body[frames.SESSION_LEN : frames.SESSION_LEN + n])
    skip = frames.SESSION_LEN + n
    return header._replace(body_len=header.body_len - skip), session, body[skip:]


def test_a_store_carries_a_finish_reason_in_its_finish_byte():
    tokens = struct.pack("<8I", *range(8))
    for code, reason in enumerate(frames.FINISH_REASONS, 1):
        head = StoreHead(ROOT, IDS[0], 4, 2, 100, 1500, session_id="s-1", finish_reason=reason)
        header, session, body = session_stripped(frames.encode_store_head(5, head, tokens))
        assert header.flags & frames.F_STORE_FINISH and session == "s-1"
        fixed = body[: frames.STORE_FIXED]
        assert fixed[52] == code and fixed[53:56] == bytes(3)  # finish:u8 pad[3]
        assert frames.decode_store_head(fixed, header, LIMITS, session) == head


def test_finish_codes_are_the_forecasts_reasons_and_stay_put():
    from sessioncache.store.forecast import FINISH_CLASSES

    assert set(frames.FINISH_REASONS) == set(FINISH_CLASSES)
    assert len(set(frames.FINISH_REASONS)) == len(frames.FINISH_REASONS)
    # the wire codes (docs/dataplane.md): new reasons go at the end
    assert frames.FINISH_REASONS[:13] == (
        "abort",
        "cancelled",
        "end_turn",
        "eos",
        "error",
        "function_call",
        "length",
        "max_tokens",
        "stop",
        "stop_sequence",
        "tool_call",
        "tool_calls",
        "tool_use",
    )


def test_a_finish_byte_without_its_flag_is_ignored_and_a_bad_one_is_refused():
    tokens = struct.pack("<8I", *range(8))
    head = StoreHead(ROOT, None, 4, 2, 100, session_id="s-1")
    header, session, body = session_stripped(frames.encode_store_head(5, head, tokens))
    fixed = bytearray(body[: frames.STORE_FIXED])
    fixed[52] = 7  # a byte that was reserved: without F_STORE_FINISH, read as before
    assert frames.decode_store_head(bytes(fixed), header, LIMITS, session) == head
    flagged = header._replace(flags=header.flags | frames.F_STORE_FINISH)
    for code in (0, len(frames.FINISH_REASONS) + 1, 255):
        fixed[52] = code
        with pytest.raises(InvalidInput, match="finish reason code"):
            frames.decode_store_head(bytes(fixed), flagged, LIMITS, session)
    fixed[52] = 1
    with pytest.raises(InvalidInput, match="must name a session"):
        frames.decode_store_head(bytes(fixed), flagged, LIMITS, None)
    # the encoder refuses the same before anything is sent
    with pytest.raises(InvalidInput, match="must name a session"):
        frames.encode_store_head(5, head._replace(session_id=None, finish_reason="stop"), tokens)
    with pytest.raises(InvalidInput, match="unknown finish_reason"):
        frames.encode_store_head(5, head._replace(finish_reason="done"), tokens)
