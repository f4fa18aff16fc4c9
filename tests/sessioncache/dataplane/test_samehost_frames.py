"""The same-host frames (SEGMENTS, LOCATE, STAGE, COMMIT, ABORT and the checked RELEASE):
every one round-trips, and the framing checks hold for them as for the stream's."""

from __future__ import annotations

import pytest

from sessioncache.dataplane import frames
from sessioncache.dataplane.frames import (
    HEADER_SIZE,
    Commit,
    Header,
    Limits,
    LocateOk,
    Lookup,
    Op,
    SegmentsOk,
    Slot,
    StageOk,
    StoreHead,
    StoreOk,
)
from sessioncache.errors import FrameError, InvalidInput
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


def test_the_same_host_ops_are_requests_with_answers():
    assert frames.SAME_HOST <= frames.REQUESTS
    for op in frames.SAME_HOST:
        assert frames.ANSWER[op] in frames.REPLIES


def test_segments_round_trip():
    header, body = split(frames.encode_segments(1, [3, 1, 2]), requests=True)
    assert header.opcode == Op.SEGMENTS and frames.decode_segments(body) == [3, 1, 2]
    ok = SegmentsOk([1, 2, 3, 9], [1, 3])
    header, body = split(frames.encode_segments_ok(1, ok), requests=False)
    assert header.opcode == Op.SEGMENTS_OK and frames.decode_segments_ok(body) == ok
    with pytest.raises(FrameError):
        frames.decode_segments(body[:-1])
    with pytest.raises(FrameError):
        frames.decode_segments_ok(body[:-2])


def test_locate_round_trips_and_needs_a_lease():
    request = Lookup(ROOT, IDS, 5000)
    header, body = split(frames.encode_locate(2, request), requests=True)
    assert header.opcode == Op.LOCATE and frames.decode_locate(body, LIMITS) == request
    _, body = split(frames.encode_locate(2, Lookup(ROOT, IDS, 0)), requests=True)
    with pytest.raises(InvalidInput, match="lease"):
        frames.decode_locate(body, LIMITS)
    ok = LocateOk(b"L" * 16, 5000, 5, [Slot(1, 0, 4096, 7), Slot(2, 8192, 4096, 1 << 63)])
    header, body = split(frames.encode_locate_ok(2, ok), requests=False)
    assert header.opcode == Op.LOCATE_OK and frames.decode_locate_ok(body) == ok
    nothing = LocateOk(None, 0, 0, [])
    assert (
        frames.decode_locate_ok(split(frames.encode_locate_ok(2, nothing), requests=False)[1])
        == nothing
    )
    with pytest.raises(FrameError):  # more located than matched
        frames.decode_locate_ok(
            split(frames.encode_locate_ok(2, ok._replace(matched=1)), requests=False)[1]
        )


def test_stage_round_trips_like_a_store_without_payloads():
    head = StoreHead(ROOT, IDS[0], 4, 3, 4096, 1000)
    tokens = bytes(4 * 4 * 3)
    header, body = split(frames.encode_stage(3, head, tokens), requests=True)
    assert header.opcode == Op.STAGE and header.flags == frames.F_STORE_PARENT
    assert len(body) == frames.STORE_FIXED + len(tokens)
    fixed = body[: frames.STORE_FIXED]
    assert frames.decode_stage_head(fixed, header, LIMITS) == head
    with pytest.raises(FrameError):  # a body_len that is not fixed + tokens
        frames.decode_stage_head(fixed, header._replace(body_len=header.body_len + 1), LIMITS)
    with pytest.raises(InvalidInput):  # limits as for a STORE
        big = head._replace(block_nbytes=2 << 20)
        h, b = split(frames.encode_stage(3, big, tokens), requests=True)
        frames.decode_stage_head(b[: frames.STORE_FIXED], h, LIMITS)
    ok = StageOk(
        b"S" * 16,
        True,
        IDS[:3],
        [BlockStatus.STORED, BlockStatus.PRESENT, BlockStatus.DROPPED],
        [Slot(4, 4096, 4096), None, None],
    )
    header, body = split(frames.encode_stage_ok(3, ok), requests=False)
    assert header.opcode == Op.STAGE_OK and frames.decode_stage_ok(body, 4096) == ok


def test_commit_abort_and_checked_release_round_trip():
    commit = Commit(b"S" * 16, 8, [4096, 0], [123, 0])
    header, body = split(frames.encode_commit(4, commit), requests=True)
    assert header.opcode == Op.COMMIT and frames.decode_commit(body, LIMITS) == commit
    with pytest.raises(InvalidInput):
        frames.encode_commit(4, commit._replace(nbytes=[1]))
    ok = StoreOk(
        False,
        IDS[:4],
        [BlockStatus.STORED, BlockStatus.REJECTED, BlockStatus.DROPPED, BlockStatus.PRESENT],
    )
    header, body = split(frames.encode_commit_ok(4, ok), requests=False)
    assert header.opcode == Op.COMMIT_OK and frames.decode_commit_ok(body) == ok
    assert BlockStatus.REJECTED == "rejected" and BlockStatus.of_code(3) is BlockStatus.REJECTED
    header, body = split(frames.encode_abort(5, b"S" * 16), requests=True)
    assert header.opcode == Op.ABORT and frames.decode_abort(body) == b"S" * 16
    assert split(frames.encode_abort_ok(5), requests=False)[0].opcode == Op.ABORT_OK
    header, body = split(frames.encode_release(6, b"L" * 16, check=True), requests=True)
    assert header.flags & frames.F_RELEASE_CHECK and frames.decode_release(body) == b"L" * 16
    header, _ = split(frames.encode_release_ok(6, live=True), requests=False)
    assert header.flags & frames.F_RELEASE_LIVE
    header, _ = split(frames.encode_release_ok(6), requests=False)
    assert not header.flags


def test_oversized_same_host_bodies_are_refused_from_the_header():
    for op in (Op.LOCATE, Op.COMMIT, Op.ABORT, Op.SEGMENTS):
        header = Header(op, 0, 1, frames.max_body(Header(op, 0, 1, 0), LIMITS) + 1)
        with pytest.raises(FrameError, match="exceeds"):
            frames.check_body(header, LIMITS)


def test_a_stage_carries_a_finish_reason_as_a_store_does():
    head = StoreHead(ROOT, IDS[0], 4, 3, 4096, 1000, session_id="s", finish_reason="end_turn")
    tokens = bytes(4 * 4 * 3)
    header, body = split(frames.encode_stage(3, head, tokens), requests=True)
    assert header.flags == frames.F_STORE_PARENT | frames.F_STORE_FINISH | frames.F_SESSION
    n = frames.session_len(body[: frames.SESSION_LEN])
    rest = body[frames.SESSION_LEN + n :]
    fixed = rest[: frames.STORE_FIXED]
    header = header._replace(body_len=len(rest))
    assert frames.decode_stage_head(fixed, header, LIMITS, "s") == head
    with pytest.raises(InvalidInput, match="must name a session"):
        frames.decode_stage_head(fixed, header, LIMITS, None)
