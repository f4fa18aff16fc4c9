"""The block stream fuzzed with hypothesis against a real node: frames with a valid header and
any body, wrong lengths (truncated, oversized), wrong counts, ids out of place. Every one gets
either a reply frame or a clean ERROR and a closed connection, within the socket timeout; the
node keeps serving a bystander connection throughout."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessioncache.dataplane import frames
from sessioncache.dataplane.frames import HEADER_SIZE, Op
from tests.sessioncache.dataplane.conftest import (
    NS,
    connect,
    raw_connect,
    raw_hello,
    read_exactly,
    settled,
    tokens,
    wait_until,
)
from tests.support.servers import Server

REQUEST_OPS = sorted(int(op) for op in frames.REQUESTS if op != Op.HELLO)


@st.composite
def hostile_frame(draw: st.DrawFn) -> tuple[bytes, bool]:
    """A request frame after HELLO, and whether the sender half-closes after it (a truncated
    body never comes whole)."""
    opcode = draw(st.sampled_from([*REQUEST_OPS, 0, 0x42, 0xFF]))
    flags = draw(st.integers(0, 0xFF))
    body = draw(
        st.one_of(
            st.binary(max_size=96),
            # a LOOKUP/LOAD-shaped body: root, lease, count and a number of ids unlike count
            st.builds(
                lambda root, lease, count, ids: struct.pack("<16sII", root, lease, count) + ids,
                st.binary(min_size=16, max_size=16),
                st.integers(0, (1 << 32) - 1),
                st.integers(0, (1 << 32) - 1),
                st.binary(max_size=80),
            ),
            # a SESSION-shaped body: JSON with a verb, maybe wrong in kind or value
            st.builds(
                lambda body: json.dumps(body).encode(),
                st.dictionaries(
                    st.sampled_from(["verb", "session_id", "kind", "ttl_s", "finish_reason", "x"]),
                    st.one_of(
                        st.sampled_from([*frames.VERBS, "stop", "agent"]),
                        st.text(max_size=8),
                        st.floats(allow_nan=True),
                        st.none(),
                    ),
                    max_size=4,
                ),
            ),
        )
    )
    lie = draw(st.sampled_from(["exact", "short", "long", "huge"]))
    declared = {
        "exact": len(body),
        "short": max(0, len(body) - 1),
        "long": len(body) + draw(st.integers(1, 64)),
        "huge": draw(st.integers(1 << 24, (1 << 64) - 1)),
    }[lie]
    header = struct.pack("<4sBBHQQ", b"SCDP", frames.VERSION, opcode, flags, 7, declared)
    return header + body, lie in ("long", "huge")


def exchange(sock: socket.socket, frame: bytes, half_close: bool) -> None:
    """Send ``frame``; read whatever comes back until a non-ERROR reply or the end."""
    sock.settimeout(10)
    with contextlib.suppress(OSError):  # the node may have closed already
        sock.sendall(frame)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
    while True:
        try:
            head = read_exactly(sock, HEADER_SIZE)
        except (EOFError, ConnectionResetError):
            return  # closed: fine
        header = frames.decode_header(head, requests=False)
        assert header.body_len < 1 << 26, header
        body = read_exactly(sock, header.body_len)
        if header.opcode == Op.ERROR:
            error = frames.decode_error(body, header.flags)
            assert "Traceback" not in error.message
            if error.closing:
                with contextlib.suppress(ConnectionResetError):
                    assert sock.recv(1) == b""
            return
        # any other reply: the node took the frame as a request it could answer
        return


@settings(
    max_examples=int(os.environ.get("SESSIONCACHE_FUZZ_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(hostile_frame())
def test_hostile_frames_never_harm_the_node(open_server: Server, case: tuple[bytes, bool]) -> None:
    frame, half_close = case
    with raw_connect(open_server) as sock:
        raw_hello(sock)
        exchange(sock, frame, half_close)


def test_the_node_serves_after_the_fuzzing(open_server: Server) -> None:
    # runs after the property above in file order; also meaningful alone
    with connect(open_server) as client:
        root = client.resolve(NS)
        ids = client.block_hashes(root, tokens(7, 3))
        assert client.lookup(root, ids).matched in (0, 3)
    wait_until(lambda: settled(open_server))
