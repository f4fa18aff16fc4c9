"""The frame header: magic, version, opcodes, flags, limits, the session section and ids
(sans I/O, shared by both ends; ``sessioncache.dataplane.frames`` describes the framing)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from enum import IntEnum
from typing import Any, NamedTuple

from sessioncache.errors import FrameError, InvalidInput
from sessioncache.hashing import HASH_BYTES

MAGIC = b"SCDP"
VERSION = 4
"""The highest data-plane version this release speaks (docs/dataplane.md, "Versions")."""
VERSIONS = frozenset({2, 3, VERSION})
"""The versions this release speaks: a HELLO negotiates the highest both ends list, and a
frame of another is refused with a closing ERROR."""
FRAME_VERSION = 2
"""The version byte of every frame whose layout version 2 defined (all but the SESSION pair):
a frame carries the version that defined it, so a peer of version 2 reads them all."""
SESSION_VERSION = 3
"""The version that added SESSION and SESSION_OK: a connection that negotiated an older one
carries neither."""
DECLINED_VERSION = 4
"""The version that added declined lookups (``F_LOOKUP_DECLINED``) and the ``declined`` count
of the miss section: a connection that negotiated an older one carries neither."""
HEADER = struct.Struct("<4sBBHQQ")
HEADER_SIZE = HEADER.size  # 24

MiB = 1 << 20
MAX_MESSAGE = 4096
"""Longest error message, in bytes."""


class Op(IntEnum):
    HELLO = 0x01
    RESOLVE = 0x02
    LOOKUP = 0x03
    LOAD = 0x04
    STORE = 0x05
    RELEASE = 0x06
    EXISTS = 0x07
    SESSION = 0x08
    # the same-host path (a Unix socket; payloads in shared memory, see SAME_HOST)
    SEGMENTS = 0x10
    LOCATE = 0x11
    STAGE = 0x12
    COMMIT = 0x13
    ABORT = 0x14
    HELLO_OK = 0x81
    RESOLVE_OK = 0x82
    LOOKUP_OK = 0x83
    BLOCK = 0x84
    STORE_OK = 0x85
    RELEASE_OK = 0x86
    EXISTS_OK = 0x87
    SESSION_OK = 0x88
    SEGMENTS_OK = 0x90
    LOCATE_OK = 0x91
    STAGE_OK = 0x92
    COMMIT_OK = 0x93
    ABORT_OK = 0x94
    ERROR = 0xFF


SAME_HOST = frozenset({Op.SEGMENTS, Op.LOCATE, Op.STAGE, Op.COMMIT, Op.ABORT})
"""Requests served on the node's same-host Unix socket only (``samehost_server.py``)."""
REQUESTS = frozenset(
    {
        Op.HELLO,
        Op.RESOLVE,
        Op.LOOKUP,
        Op.LOAD,
        Op.STORE,
        Op.RELEASE,
        Op.EXISTS,
        Op.SESSION,
        *SAME_HOST,
    }
)
REPLIES = frozenset(set(Op) - REQUESTS)
ANSWER: dict[Op, Op] = {
    Op.HELLO: Op.HELLO_OK,
    Op.RESOLVE: Op.RESOLVE_OK,
    Op.LOOKUP: Op.LOOKUP_OK,
    Op.LOAD: Op.BLOCK,
    Op.STORE: Op.STORE_OK,
    Op.RELEASE: Op.RELEASE_OK,
    Op.EXISTS: Op.EXISTS_OK,
    Op.SESSION: Op.SESSION_OK,
    Op.SEGMENTS: Op.SEGMENTS_OK,
    Op.LOCATE: Op.LOCATE_OK,
    Op.STAGE: Op.STAGE_OK,
    Op.COMMIT: Op.COMMIT_OK,
    Op.ABORT: Op.ABORT_OK,
}
"""The frame that answers each request when it succeeds."""

# flags
F_LOAD_BY_LEASE = 0x1
"""LOAD: the body names a lease of this connection (else: a list of ids)."""
F_LOAD_RELEASE = 0x2
"""LOAD by lease: release the lease once its blocks are sent."""
F_STORE_PARENT = 0x1
"""STORE: the chain continues from ``parent`` (else: from the namespace root)."""
F_STORE_KEYED = 0x2
"""STORE, STAGE: keyed blocks. The token section holds one 16-byte block key per block
(``block_tokens`` is ``KEY_WORDS``) and each id is ``hashing.keyed_block_ids`` of the root
and the key; with ``F_STORE_PARENT`` block 0 hangs off ``parent``."""
F_STORE_LINKED = 0x4
"""STORE, STAGE of keyed blocks: block ``i`` hangs off block ``i - 1`` (the batch is one
request's consecutive chunks), so that tail-first eviction treats it as a chain; without it
every keyed block but a parented block 0 stands alone."""
F_STORE_DURABLE = 0x8
"""STORE, STAGE: answer once every block is on the durable tier (fsync-ed), and say
``durable``; without it a block is acknowledged once its first tier holds it, and its durable
copy follows (write-behind), unless the node makes every store durable."""
F_STORE_FINISH = 0x10
"""STORE, STAGE (with ``F_SESSION``): the request whose KV this is has finished, for the
reason whose code (``FINISH_REASONS``) is the fixed part's ``finish`` byte; the node files the
session's chain under the forecast that follows (``SessionManager.record``). Without the flag
the byte is ignored (a client of before the flag sent 0)."""
FINISH_REASONS: tuple[str, ...] = (
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
"""The finish reasons by wire code: reason ``FINISH_REASONS[code - 1]`` (code 0 is none). The
codes are the frame format: a new reason goes at the end (``forecast.FINISH_CLASSES`` names
the same ones)."""
F_LOOKUP_KEYED = 0x1
"""LOOKUP, LOCATE: the ids are keyed ids, each held under the root on its own (not a chain):
the match is the run of them, from the first, that the node holds under the root."""
F_LOAD_EACH = 0x4
"""LOAD by ids: every id on its own: each held one is sent, each other one is missing (without
it, everything after the first missing block is missing)."""
KEY_WORDS = HASH_BYTES // 4
"""``block_tokens`` of a keyed STORE or STAGE: a 16-byte key is four ``u32`` words."""
F_SESSION = 0x100
"""LOOKUP, LOAD, LOCATE, STORE, STAGE: the body starts with a session section
(``len:u16`` and that many bytes of UTF-8, the id of an open session of the caller's), then
the op's own body. The request acts on behalf of that session (its TTL, chain pins, head,
token totals), as the REST API's ``session_id`` does."""
SESSION_OPS = frozenset({Op.LOOKUP, Op.LOAD, Op.LOCATE, Op.STORE, Op.STAGE})
MAX_SESSION_BYTES = 512
"""Longest session section body (a session id is at most 128 characters)."""
F_UNCOUNTED = 0x80
"""LOOKUP, LOCATE, EXISTS: not a prompt's question (a probe, or a fetch of blocks an earlier
request counted): its tokens are left out of the hit and miss totals (docs/metrics.md)."""
F_LOOKUP_EXPLAIN = 0x2
"""LOOKUP: LOOKUP_OK ends with a miss section saying why the rest missed (``Miss``)."""
F_LOOKUP_DECLINED = 0x4
"""LOOKUP (version 4): the caller will load nothing (its engine cannot continue from a cached
context). Nothing matches, nothing is leased or touched, and every token counts as missed,
those the node holds as ``declined``; ``lease_ms`` must be 0."""
F_BLOCK_MISSING = 0x1
"""BLOCK: the block is not held (or not the caller's); empty body."""
F_ERROR_CLOSING = 0x1
"""ERROR: the node closes the connection after this frame."""
F_RELEASE_CHECK = 0x1
"""RELEASE: answer whether the lease was still live (``F_RELEASE_LIVE``) instead of an error
for a lease that is over."""
F_RELEASE_LIVE = 0x1
"""RELEASE_OK to a checked RELEASE: the lease's blocks stayed pinned from the lookup until
this release (a same-host reader whose answer lacks it discards what it copied)."""

# Block statuses in STORE_OK, STAGE_OK and COMMIT_OK are ``BlockStatus`` codes, one byte each
# (STAGE_OK: STORED means "staged, fill the slot"); only this codec sees the codes.


class Limits(NamedTuple):
    """What one request may carry; the node announces its own in ``HELLO_OK``."""

    max_ids: int = 16384
    """Most block ids (or blocks) in one request."""
    max_block_bytes: int = 256 * MiB
    """Largest block payload."""
    max_tokens: int = 2_000_000
    """Most tokens in one STORE."""
    max_json: int = 64 << 10
    """Largest JSON body (HELLO, RESOLVE and their answers)."""


class Header(NamedTuple):
    opcode: Op
    flags: int
    request_id: int
    body_len: int


def encode_header(
    opcode: Op, request_id: int, body_len: int, flags: int = 0, *, version: int = FRAME_VERSION
) -> bytes:
    return HEADER.pack(MAGIC, version, opcode, flags, request_id, body_len)


def frame(
    opcode: Op, request_id: int, body: bytes, flags: int = 0, *, version: int = FRAME_VERSION
) -> bytes:
    """A whole frame without a session section: its header, then ``body``."""
    return encode_header(opcode, request_id, len(body), flags, version=version) + body


def fixed_part(
    layout: struct.Struct, data: bytes, what: str, part: str = "fixed part"
) -> tuple[Any, ...]:
    """The fields of the ``layout`` at the start of a ``what`` body; ``FrameError`` when the
    body is shorter (``part`` names what it lacks)."""
    if len(data) < layout.size:
        raise FrameError(f"{what}: body shorter than its {part}")
    return layout.unpack_from(data)


class VersionError(FrameError):
    """A frame of a version this end does not speak (the other end is of another release)."""

    def __init__(self, version: int) -> None:
        super().__init__(
            f"frame version {version}; this end speaks version "
            f"{'/'.join(map(str, sorted(VERSIONS)))}: the client and the node must come from "
            "releases that share a frame version (docs/dataplane.md, Versions)"
        )
        self.version = version


# -- the session section --------------------------------------------------------------------

_SESSION = struct.Struct("<H")


def session_section(session_id: str | None) -> bytes:
    """The session section that starts a request's body (empty without a session)."""
    if session_id is None:
        return b""
    data = session_id.encode("utf-8")
    if not 0 < len(data) <= MAX_SESSION_BYTES:
        raise InvalidInput(f"a session id is 1 to {MAX_SESSION_BYTES} bytes of UTF-8")
    return _SESSION.pack(len(data)) + data


SESSION_LEN = _SESSION.size


def session_len(prefix: bytes) -> int:
    """The length of a session id from its section's 2-byte prefix."""
    (n,) = _SESSION.unpack(prefix)
    if not 0 < n <= MAX_SESSION_BYTES:
        raise FrameError(f"a session section of {n} bytes; 1 to {MAX_SESSION_BYTES}")
    return int(n)


def decode_session(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInput("the session id is not UTF-8") from None


def _with_session(
    opcode: Op, request_id: int, flags: int, body: bytes, session_id: str | None, extra: int = 0
) -> bytes:
    """A request's header and body, the session section first when there is one; ``extra``
    bytes of body (payloads) follow, sent by the caller."""
    section = session_section(session_id)
    if section:
        flags |= F_SESSION
    return (
        encode_header(opcode, request_id, len(section) + len(body) + extra, flags) + section + body
    )


def decode_header(data: bytes | bytearray | memoryview, *, requests: bool) -> Header:
    """Parse and check a header: the magic, the version, and an opcode a node (``requests``)
    or a client (replies) may receive. Limits on ``body_len`` are checked by ``check_body``."""
    if len(data) != HEADER_SIZE:
        raise FrameError(f"a header is {HEADER_SIZE} bytes, got {len(data)}")
    magic, version, opcode, flags, request_id, body_len = HEADER.unpack(data)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}: not a sessioncache data-plane frame")
    if version not in VERSIONS:
        raise VersionError(version)
    try:
        op = Op(opcode)
    except ValueError:
        raise FrameError(f"unknown opcode 0x{opcode:02x}") from None
    if (op in REQUESTS) != requests:
        raise FrameError(f"opcode {op.name} is not {'a request' if requests else 'an answer'}")
    return Header(op, flags, request_id, body_len)


# -- ids ---------------------------------------------------------------------------------------


def join_ids(ids: Sequence[bytes]) -> bytes:
    for block_id in ids:
        if not isinstance(block_id, bytes | bytearray) or len(block_id) != HASH_BYTES:
            raise InvalidInput(f"a block id is {HASH_BYTES} bytes, got {block_id!r:.60}")
    return b"".join(ids)


def split_ids(data: bytes, offset: int, count: int) -> list[bytes]:
    end = offset + HASH_BYTES * count
    if len(data) != end:
        raise FrameError(f"expected {count} ids ({end} bytes of body), got {len(data)} bytes")
    return [data[i : i + HASH_BYTES] for i in range(offset, end, HASH_BYTES)]


def finish_code(reason: str) -> int:
    """The wire code of a finish reason (``FINISH_REASONS``); ``InvalidInput`` for another."""
    try:
        return FINISH_REASONS.index(reason) + 1
    except ValueError:
        raise InvalidInput(
            f"unknown finish_reason {reason!r}; finish reasons are {sorted(FINISH_REASONS)}"
        ) from None


def finish_reason(code: int) -> str:
    """The finish reason of a wire code; ``InvalidInput`` for an unknown code."""
    if not 1 <= code <= len(FINISH_REASONS):
        raise InvalidInput(
            f"finish reason code {code}; the codes are 1 to {len(FINISH_REASONS)} (FINISH_REASONS)"
        )
    return FINISH_REASONS[code - 1]


def _check_count(count: int, limits: Limits, what: str) -> None:
    if not 1 <= count <= limits.max_ids:
        raise InvalidInput(f"{what}: {count} blocks; a request carries 1 to {limits.max_ids}")
