"""The data plane's frames: encoding and decoding, no I/O (``docs/dataplane.md`` is the spec).

Every frame is a fixed 24-byte little-endian header and a body of ``body_len`` bytes::

    offset  size  field
         0     4  magic        b"SCDP"
         4     1  version      2 (``VERSION``; see "Versions" in docs/dataplane.md)
         5     1  opcode       ``Op``
         6     2  flags        per opcode (``F_*``)
         8     8  request id   chosen by the client, echoed in every frame of the answer
        16     8  body_len     bytes of body following the header

The client sends requests (``HELLO`` first, then any of the others) and reads each one's
answer before the next: one ``*_OK`` frame, or for ``LOAD`` one ``BLOCK`` frame per block
asked, or an ``ERROR`` frame (which may cut a ``LOAD`` short). Bodies are described beside
their encoders below; ids and roots are 16 raw bytes, tokens little-endian ``u32``.

Everything here is pure: the node (``server.py``) and the client (``client.py``) do the
socket work and call these to build and check bytes, so both ends share one definition. A
decoder that meets bytes breaking the framing raises ``FrameError`` (the connection is then
closed); values that are well framed but wrong raise ``InvalidInput``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from enum import IntEnum
from typing import Any, NamedTuple

from sessioncache.errors import FrameError, InvalidInput
from sessioncache.hashing import HASH_BYTES, Namespace
from sessioncache.status import BlockStatus

MAGIC = b"SCDP"
VERSION = 2
"""The frame version both ends of this release speak (docs/dataplane.md, "Versions")."""
VERSIONS = frozenset({VERSION})
"""The versions a node serves; a HELLO of another is refused with a closing ERROR."""
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
    SEGMENTS_OK = 0x90
    LOCATE_OK = 0x91
    STAGE_OK = 0x92
    COMMIT_OK = 0x93
    ABORT_OK = 0x94
    ERROR = 0xFF


SAME_HOST = frozenset({Op.SEGMENTS, Op.LOCATE, Op.STAGE, Op.COMMIT, Op.ABORT})
"""Requests served on the node's same-host Unix socket only (``samehost_server.py``)."""
REQUESTS = frozenset(
    {Op.HELLO, Op.RESOLVE, Op.LOOKUP, Op.LOAD, Op.STORE, Op.RELEASE, Op.EXISTS, *SAME_HOST}
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
    opcode: Op, request_id: int, body_len: int, flags: int = 0, *, version: int = VERSION
) -> bytes:
    return HEADER.pack(MAGIC, version, opcode, flags, request_id, body_len)


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


def max_body(header: Header, limits: Limits) -> int:
    """The longest body a frame of this opcode may have under ``limits``."""
    ids = HASH_BYTES * limits.max_ids
    op = header.opcode
    if header.flags & F_SESSION and op in SESSION_OPS:
        bare = header._replace(flags=header.flags & ~F_SESSION)
        return SESSION_LEN + MAX_SESSION_BYTES + max_body(bare, limits)
    if op in (Op.HELLO, Op.RESOLVE, Op.HELLO_OK):
        return limits.max_json
    if op == Op.LOOKUP:
        return _LOOKUP.size + ids
    if op == Op.LOAD:
        return _LOAD_LEASE.size if header.flags & F_LOAD_BY_LEASE else _COUNT.size + ids
    if op == Op.STORE:
        return _STORE.size + 4 * limits.max_tokens + limits.max_ids * limits.max_block_bytes
    if op == Op.RELEASE:
        return HASH_BYTES
    if op == Op.EXISTS:
        return _LOOKUP.size + ids
    if op == Op.EXISTS_OK:
        return _COUNT.size + limits.max_ids
    if op == Op.RESOLVE_OK:
        return HASH_BYTES
    if op == Op.LOOKUP_OK:
        return _LOOKUP_OK.size + 9 * limits.max_ids + _MISS.size
    if op == Op.BLOCK:
        return limits.max_block_bytes
    if op == Op.STORE_OK:
        return _STORE_OK.size + (HASH_BYTES + 1) * limits.max_ids
    if op in (Op.RELEASE_OK, Op.ABORT_OK):
        return 0
    if op == Op.SEGMENTS:
        return _COUNT.size + 4 * MAX_SEGMENTS
    if op == Op.LOCATE:
        return _LOOKUP.size + ids
    if op == Op.STAGE:
        return _STORE.size + 4 * limits.max_tokens
    if op == Op.COMMIT:
        return _COMMIT.size + _COMMIT_BLOCK.size * limits.max_ids
    if op == Op.ABORT:
        return HASH_BYTES
    if op == Op.SEGMENTS_OK:
        return _SEGMENTS_OK.size + 4 * (MAX_SEGMENTS + MAX_FDS)
    if op == Op.LOCATE_OK:
        return _LOCATE_OK.size + _SLOT.size * limits.max_ids
    if op == Op.STAGE_OK:
        return _STAGE_OK.size + (HASH_BYTES + _STAGED.size) * limits.max_ids
    if op == Op.COMMIT_OK:
        return _STORE_OK.size + (HASH_BYTES + 1) * limits.max_ids
    return _ERROR.size + MAX_MESSAGE  # ERROR


def check_body(header: Header, limits: Limits) -> None:
    """Refuse a body longer than its opcode allows (before reading any of it)."""
    limit = max_body(header, limits)
    if header.body_len > limit:
        raise FrameError(
            f"{header.opcode.name} body of {header.body_len} bytes exceeds the limit of {limit}"
        )


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


def _check_count(count: int, limits: Limits, what: str) -> None:
    if not 1 <= count <= limits.max_ids:
        raise InvalidInput(f"{what}: {count} blocks; a request carries 1 to {limits.max_ids}")


# -- JSON bodies (HELLO, RESOLVE, HELLO_OK) ------------------------------------------------


def _json_body(data: bytes, what: str) -> dict[str, Any]:
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise FrameError(f"{what}: the body is not JSON") from None
    if not isinstance(body, dict):
        raise FrameError(f"{what}: the body is not a JSON object")
    return body


def _json_frame(opcode: Op, request_id: int, body: dict[str, Any]) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    return encode_header(opcode, request_id, len(data)) + data


class Hello(NamedTuple):
    """HELLO (JSON ``{"api_key": str | null, "client": str, "versions": [int]}``): the first
    frame of a connection. The node maps the key to a tenant exactly as the REST API does, and
    answers in the highest of ``versions`` it speaks (or refuses, closing)."""

    api_key: str | None
    client: str = ""
    versions: tuple[int, ...] = (VERSION,)


def encode_hello(request_id: int, hello: Hello) -> bytes:
    body = {"api_key": hello.api_key, "client": hello.client, "versions": list(hello.versions)}
    return _json_frame(Op.HELLO, request_id, body)


def decode_hello(data: bytes) -> Hello:
    body = _json_body(data, "HELLO")
    key = body.get("api_key")
    client = body.get("client", "")
    versions = body.get("versions", [VERSION])
    if key is not None and not isinstance(key, str):
        raise FrameError("HELLO: api_key must be a string or null")
    if not isinstance(client, str):
        raise FrameError("HELLO: client must be a string")
    if not isinstance(versions, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in versions
    ):
        raise FrameError("HELLO: versions must be a list of integers")
    return Hello(key, client, tuple(versions))


def negotiate(hello: Hello) -> int:
    """The version a node answers a HELLO in: the highest both ends speak."""
    common = VERSIONS.intersection(hello.versions)
    if not common:
        raise VersionError(max(hello.versions, default=0))
    return max(common)


class HelloOk(NamedTuple):
    """HELLO_OK (JSON ``{"version", "tenant", "auth", "tiers", "max_ids", "max_block_bytes",
    "max_tokens", "max_json"}``): who the caller is and the node's limits. ``tiers`` names
    the tier indexes of LOOKUP_OK."""

    tenant: str
    auth: bool
    tiers: tuple[str, ...]
    limits: Limits
    version: int = VERSION


def encode_hello_ok(request_id: int, ok: HelloOk) -> bytes:
    return _json_frame(
        Op.HELLO_OK,
        request_id,
        {
            "version": ok.version,
            "tenant": ok.tenant,
            "auth": ok.auth,
            "tiers": list(ok.tiers),
            **ok.limits._asdict(),
        },
    )


def decode_hello_ok(data: bytes) -> HelloOk:
    body = _json_body(data, "HELLO_OK")
    try:
        limits = Limits(**{name: int(body[name]) for name in Limits._fields})
        tiers = tuple(str(t) for t in body["tiers"])
        tenant, auth, version = body["tenant"], body["auth"], int(body["version"])
    except (KeyError, TypeError, ValueError) as exc:
        raise FrameError(f"HELLO_OK: missing or bad field: {exc}") from None
    if not isinstance(tenant, str) or not isinstance(auth, bool):
        raise FrameError("HELLO_OK: bad tenant or auth")
    if version not in VERSIONS:
        raise VersionError(version)
    return HelloOk(tenant, auth, tiers, limits, version)


def encode_resolve(request_id: int, namespace: Namespace) -> bytes:
    """RESOLVE (JSON namespace, as in the REST API): the caller's root of that namespace."""
    return _json_frame(Op.RESOLVE, request_id, namespace.as_json())


def decode_resolve(data: bytes) -> Namespace:
    body = _json_body(data, "RESOLVE")
    fields = {"model", "block_tokens", "kv_dtype", "kv_layout", "salt", "lora"}
    unknown = set(body) - fields
    if unknown:
        raise InvalidInput(f"RESOLVE: unknown namespace fields {sorted(unknown)}")
    try:
        return Namespace(**body)
    except TypeError as exc:
        raise InvalidInput(f"RESOLVE: not a namespace: {exc}") from None


def encode_resolve_ok(request_id: int, root: bytes) -> bytes:
    """RESOLVE_OK: the 16-byte root."""
    return encode_header(Op.RESOLVE_OK, request_id, len(root)) + root


def decode_resolve_ok(data: bytes) -> bytes:
    if len(data) != HASH_BYTES:
        raise FrameError(f"RESOLVE_OK: a root is {HASH_BYTES} bytes, got {len(data)}")
    return bytes(data)


# -- LOOKUP --------------------------------------------------------------------------------

_LOOKUP = struct.Struct("<16sII")  # root, lease_ms, count; then count ids
_COUNT = struct.Struct("<I")
_LOOKUP_OK = struct.Struct("<16sII")  # lease (zeros: none), lease_ms, matched


class Lookup(NamedTuple):
    """LOOKUP (``root[16] lease_ms:u32 count:u32 ids[16 x count]``): the longest held prefix
    of ``ids`` that belongs to the caller, leased for ``lease_ms`` (0: no lease). ``root``
    must have been resolved on this connection."""

    root: bytes
    ids: list[bytes]
    lease_ms: int = 0
    keyed: bool = False
    """``F_LOOKUP_KEYED``: keyed ids, each held under the root on its own."""
    session_id: str | None = None
    """``F_SESSION``: on behalf of this session."""
    counted: bool = True
    """Without ``F_UNCOUNTED``: a prompt's question, counted in the token totals."""
    explain: bool = False
    """``F_LOOKUP_EXPLAIN``: the answer says why the rest missed."""

    @property
    def flags(self) -> int:
        flags = F_LOOKUP_KEYED if self.keyed else 0
        flags |= 0 if self.counted else F_UNCOUNTED
        return flags | (F_LOOKUP_EXPLAIN if self.explain else 0)


def encode_lookup(request_id: int, lookup: Lookup) -> bytes:
    body = _LOOKUP.pack(lookup.root, lookup.lease_ms, len(lookup.ids)) + join_ids(lookup.ids)
    return _with_session(Op.LOOKUP, request_id, lookup.flags, body, lookup.session_id)


def decode_lookup(
    data: bytes, limits: Limits, flags: int = 0, session_id: str | None = None
) -> Lookup:
    """A LOOKUP's body (after its session section, whose id the server read already)."""
    if len(data) < _LOOKUP.size:
        raise FrameError("LOOKUP: body shorter than its fixed part")
    root, lease_ms, count = _LOOKUP.unpack_from(data)
    ids = split_ids(data, _LOOKUP.size, count)
    _check_count(count, limits, "LOOKUP")
    return Lookup(
        root,
        ids,
        lease_ms,
        bool(flags & F_LOOKUP_KEYED),
        session_id,
        not flags & F_UNCOUNTED,
        bool(flags & F_LOOKUP_EXPLAIN),
    )


class Exists(NamedTuple):
    """EXISTS (``root[16] 0:u32 count:u32 ids[16 x count]``, a LOOKUP's layout): which of
    ``ids`` the node holds under ``root`` (resolved on this connection), each on its own,
    chained or keyed. Nothing is touched or leased."""

    root: bytes
    ids: list[bytes]
    counted: bool = True
    """Without ``F_UNCOUNTED``: a prompt's question (LMCache's lookup), counted."""


def encode_exists(request_id: int, *, exists: Exists) -> bytes:
    body = _LOOKUP.pack(exists.root, 0, len(exists.ids)) + join_ids(exists.ids)
    flags = 0 if exists.counted else F_UNCOUNTED
    return encode_header(Op.EXISTS, request_id, len(body), flags) + body


def decode_exists(data: bytes, limits: Limits, flags: int = 0) -> Exists:
    lookup = decode_lookup(data, limits)
    return Exists(lookup.root, lookup.ids, not flags & F_UNCOUNTED)


def encode_exists_ok(request_id: int, held: Sequence[bool]) -> bytes:
    """EXISTS_OK (``count:u32 held[u8 x count]``): 1 for each id held under the root."""
    body = _COUNT.pack(len(held)) + bytes(1 if h else 0 for h in held)
    return encode_header(Op.EXISTS_OK, request_id, len(body)) + body


def decode_exists_ok(data: bytes) -> list[bool]:
    if len(data) < _COUNT.size:
        raise FrameError("EXISTS_OK: body shorter than its count")
    (count,) = _COUNT.unpack_from(data)
    if len(data) != _COUNT.size + count:
        raise FrameError(f"EXISTS_OK: {len(data)} bytes of body for {count} ids")
    return [b != 0 for b in data[_COUNT.size :]]


class LookupOk(NamedTuple):
    """LOOKUP_OK (``lease[16] lease_ms:u32 matched:u32 nbytes[u64 x matched]
    tier[u8 x matched]``): the matched blocks' payload sizes and fastest tiers (indexes into
    HELLO_OK's ``tiers``); ``lease`` is all zeros when nothing was leased."""

    lease: bytes | None
    lease_ms: int
    nbytes: list[int]
    tiers: list[int]
    miss: Miss | None = None
    """With ``F_LOOKUP_EXPLAIN`` asked: why the rest missed."""


_NO_LEASE = bytes(HASH_BYTES)
MISS_REASONS = ("diverged", "evicted", "expired", "new")
"""Reason codes of a miss section, in order (``attribution.REASONS``)."""
MISS_PRESSURES = ("capacity", "pin_budget")
_NONE = 0xFF
_NO_INDEX = 0xFFFFFFFF
# flags (1: a first cause), reason, pressure, tier, block, token, offset, ago_s; then tokens
_MISS = struct.Struct(f"<BBBBIIId{len(MISS_REASONS)}Q")


class Miss(NamedTuple):
    """The miss section of a LOOKUP_OK (``F_LOOKUP_EXPLAIN``): ``has_first:u8 reason:u8
    pressure:u8 tier:u8 block:u32 token:u32 offset:u32 ago_s:f64``, then one ``u64`` of
    missed tokens per reason of ``MISS_REASONS``. Absent values are ``0xff`` (codes, tier),
    ``0xffffffff`` (offset) and NaN (``ago_s``). ``tier`` indexes HELLO_OK's tiers. The REST
    API's ``miss`` object, in binary (docs/prompt-stability.md)."""

    reason: int | None
    block: int | None
    token: int | None
    offset: int | None
    tier: int | None
    ago_s: float | None
    pressure: int | None
    tokens: tuple[int, ...]


def _encode_miss(miss: Miss) -> bytes:
    first = miss.reason is not None
    return _MISS.pack(
        1 if first else 0,
        miss.reason if miss.reason is not None else _NONE,
        miss.pressure if miss.pressure is not None else _NONE,
        miss.tier if miss.tier is not None else _NONE,
        miss.block or 0,
        miss.token or 0,
        miss.offset if miss.offset is not None else _NO_INDEX,
        miss.ago_s if miss.ago_s is not None else float("nan"),
        *miss.tokens,
    )


def _decode_miss(data: bytes, offset: int) -> Miss:
    first, reason, pressure, tier, block, token, off, ago, *tokens = _MISS.unpack_from(data, offset)
    return Miss(
        reason if first else None,
        block if first else None,
        token if first else None,
        off if first and off != _NO_INDEX else None,
        tier if first and tier != _NONE else None,
        ago if first and ago == ago else None,  # NaN: none
        pressure if first and pressure != _NONE else None,
        tuple(tokens),
    )


def encode_lookup_ok(request_id: int, ok: LookupOk) -> bytes:
    n = len(ok.nbytes)
    parts = [
        _LOOKUP_OK.pack(ok.lease or _NO_LEASE, ok.lease_ms, n),
        struct.pack(f"<{n}Q", *ok.nbytes),
        bytes(ok.tiers),
    ]
    if ok.miss is not None:
        parts.append(_encode_miss(ok.miss))
    body = b"".join(parts)
    return encode_header(Op.LOOKUP_OK, request_id, len(body)) + body


def decode_lookup_ok(data: bytes) -> LookupOk:
    if len(data) < _LOOKUP_OK.size:
        raise FrameError("LOOKUP_OK: body shorter than its fixed part")
    lease, lease_ms, n = _LOOKUP_OK.unpack_from(data)
    end = _LOOKUP_OK.size + 9 * n
    if len(data) not in (end, end + _MISS.size):
        raise FrameError(f"LOOKUP_OK: {len(data)} bytes of body for {n} blocks")
    nbytes = list(struct.unpack_from(f"<{n}Q", data, _LOOKUP_OK.size))
    tiers = list(data[_LOOKUP_OK.size + 8 * n : end])
    miss = _decode_miss(data, end) if len(data) > end else None
    return LookupOk(None if lease == _NO_LEASE else lease, lease_ms, nbytes, tiers, miss)


# -- LOAD ----------------------------------------------------------------------------------

_LOAD_LEASE = struct.Struct("<16sII")  # lease, start, count


class LoadLease(NamedTuple):
    """LOAD with ``F_LOAD_BY_LEASE`` (``lease[16] start:u32 blocks:u32``): blocks
    ``start .. start + blocks`` of a lease this connection's LOOKUP took; with
    ``F_LOAD_RELEASE`` the lease is released after the last block."""

    lease: bytes
    start: int
    blocks: int
    release: bool = False
    session_id: str | None = None


class LoadIds(NamedTuple):
    """LOAD without flags (``count:u32 ids[16 x count]``): the held prefix of ``ids`` that is
    the caller's, leased only while it is sent; every block past it answers missing."""

    ids: list[bytes]
    each: bool = False
    """``F_LOAD_EACH``: every id on its own (a held block after a missing one is sent)."""
    session_id: str | None = None
    """``F_SESSION``: on behalf of this session (its TTL, chain pins and head)."""


def encode_load(request_id: int, load: LoadLease | LoadIds) -> bytes:
    if isinstance(load, LoadLease):
        flags = F_LOAD_BY_LEASE | (F_LOAD_RELEASE if load.release else 0)
        body = _LOAD_LEASE.pack(load.lease, load.start, load.blocks)
    else:
        flags = F_LOAD_EACH if load.each else 0
        body = _COUNT.pack(len(load.ids)) + join_ids(load.ids)
    return _with_session(Op.LOAD, request_id, flags, body, load.session_id)


def decode_load(
    data: bytes, flags: int, limits: Limits, session_id: str | None = None
) -> LoadLease | LoadIds:
    if flags & F_LOAD_BY_LEASE:
        if len(data) != _LOAD_LEASE.size:
            raise FrameError(f"LOAD by lease: the body is {_LOAD_LEASE.size} bytes")
        lease, start, count = _LOAD_LEASE.unpack(data)
        _check_count(count, limits, "LOAD")
        return LoadLease(lease, start, count, bool(flags & F_LOAD_RELEASE), session_id)
    if len(data) < _COUNT.size:
        raise FrameError("LOAD: body shorter than its count")
    (count,) = _COUNT.unpack_from(data)
    ids = split_ids(data, _COUNT.size, count)
    _check_count(count, limits, "LOAD")
    return LoadIds(ids, bool(flags & F_LOAD_EACH), session_id)


def block_header(request_id: int, nbytes: int, *, missing: bool = False) -> bytes:
    """BLOCK: the payload of one block (body = its bytes), in the order asked; with
    ``F_BLOCK_MISSING`` and an empty body when the block is not held."""
    return encode_header(Op.BLOCK, request_id, nbytes, F_BLOCK_MISSING if missing else 0)


# -- STORE ---------------------------------------------------------------------------------

_STORE = struct.Struct("<16s16sIIQII")  # root, parent, block_tokens, count, nbytes, ttl_ms, 0


class StoreHead(NamedTuple):
    """STORE (``root[16] parent[16] block_tokens:u32 blocks:u32 block_nbytes:u64 ttl_ms:u32
    reserved:u32``, then ``blocks x block_tokens`` tokens as ``u32``, then ``blocks`` payloads
    of ``block_nbytes`` each): a chain segment continuing from ``parent`` (with
    ``F_STORE_PARENT``; else from ``root``, and ``parent`` is zeros). The node derives each
    block's id from its parent and tokens; ``ttl_ms`` 0 is the node's default TTL."""

    root: bytes
    parent: bytes | None
    block_tokens: int
    blocks: int
    block_nbytes: int
    ttl_ms: int = 0
    keyed: bool = False
    """``F_STORE_KEYED``: the token section holds block keys (``block_tokens`` = ``KEY_WORDS``)."""
    linked: bool = True
    """``F_STORE_LINKED`` for keyed blocks (a chain segment always is)."""
    session_id: str | None = None
    """``F_SESSION``: on behalf of this session (its TTL, chain pins and head)."""

    @property
    def flags(self) -> int:
        flags = F_STORE_PARENT if self.parent is not None else 0
        if self.keyed:
            flags |= F_STORE_KEYED | (F_STORE_LINKED if self.linked else 0)
        return flags

    @property
    def token_bytes(self) -> int:
        return 4 * self.block_tokens * self.blocks

    @property
    def body_len(self) -> int:
        return _STORE.size + self.token_bytes + self.blocks * self.block_nbytes


STORE_FIXED = _STORE.size


def _head(
    flags: int,
    root: bytes,
    parent: bytes,
    block_tokens: int,
    count: int,
    nbytes: int,
    ttl_ms: int,
    session_id: str | None = None,
) -> StoreHead:
    keyed = bool(flags & F_STORE_KEYED)
    if keyed and block_tokens != KEY_WORDS:
        raise InvalidInput(
            f"a keyed STORE carries {HASH_BYTES}-byte keys: block_tokens must be {KEY_WORDS}"
        )
    return StoreHead(
        root,
        parent if flags & F_STORE_PARENT else None,
        block_tokens,
        count,
        nbytes,
        ttl_ms,
        keyed,
        bool(flags & F_STORE_LINKED) or not keyed,
        session_id,
    )


def encode_store_head(request_id: int, head: StoreHead, token_bytes: bytes) -> bytes:
    """Header, fixed part and tokens of a STORE; the payloads follow, ``count`` of them."""
    if len(token_bytes) != head.token_bytes:
        raise InvalidInput(
            f"{len(token_bytes) // 4} tokens for {head.blocks} blocks of {head.block_tokens}"
        )
    flags = head.flags
    fixed = _STORE.pack(
        head.root,
        head.parent or _NO_LEASE,
        head.block_tokens,
        head.blocks,
        head.block_nbytes,
        head.ttl_ms,
        0,
    )
    payloads = head.blocks * head.block_nbytes
    return _with_session(
        Op.STORE, request_id, flags, fixed + token_bytes, head.session_id, payloads
    )


def decode_store_head(
    fixed: bytes, header: Header, limits: Limits, session_id: str | None = None
) -> StoreHead:
    """The fixed part of a STORE, checked against ``limits`` and the header's ``body_len``
    (what follows the session section)."""
    root, parent, block_tokens, count, nbytes, ttl_ms, _ = _STORE.unpack(fixed)
    head = _head(header.flags, root, parent, block_tokens, count, nbytes, ttl_ms, session_id)
    if head.body_len != header.body_len:
        raise FrameError(
            f"STORE: body_len {header.body_len} but its head describes {head.body_len} bytes"
        )
    _check_count(count, limits, "STORE")
    if block_tokens < 1 or count * block_tokens > limits.max_tokens:
        raise InvalidInput(
            f"STORE: {count} blocks of {block_tokens} tokens; at most {limits.max_tokens} tokens"
        )
    if not 1 <= nbytes <= limits.max_block_bytes:
        raise InvalidInput(
            f"STORE: payloads of {nbytes} bytes; a block is 1 to {limits.max_block_bytes} bytes"
        )
    return head


_STORE_OK = struct.Struct("<IBxxx")  # count, durable


class StoreOk(NamedTuple):
    """STORE_OK (``count:u32 durable:u8 pad[3] ids[16 x count] status[u8 x count]``): each
    block's id as the node derived it, and ``STORED``, ``PRESENT`` (already held) or
    ``DROPPED`` (no room; the rest of the segment then is too)."""

    durable: bool
    ids: list[bytes]
    status: list[BlockStatus]


def _status_bytes(status: Sequence[BlockStatus]) -> bytes:
    return bytes(s.code for s in status)


def _statuses(data: bytes, what: str) -> list[BlockStatus]:
    try:
        return [BlockStatus.of_code(code) for code in data]
    except InvalidInput as exc:
        raise FrameError(f"{what}: {exc}") from None


def encode_store_ok(request_id: int, ok: StoreOk) -> bytes:
    body = _STORE_OK.pack(len(ok.ids), ok.durable) + join_ids(ok.ids) + _status_bytes(ok.status)
    return encode_header(Op.STORE_OK, request_id, len(body)) + body


def decode_store_ok(data: bytes) -> StoreOk:
    if len(data) < _STORE_OK.size:
        raise FrameError("STORE_OK: body shorter than its fixed part")
    n, durable = _STORE_OK.unpack_from(data)
    end = _STORE_OK.size + HASH_BYTES * n
    if len(data) != end + n:
        raise FrameError(f"STORE_OK: {len(data)} bytes of body for {n} blocks")
    ids = split_ids(data[:end], _STORE_OK.size, n)
    return StoreOk(bool(durable), ids, _statuses(data[end:], "STORE_OK"))


# -- RELEASE and ERROR ---------------------------------------------------------------------


def encode_release(request_id: int, lease: bytes, *, check: bool = False) -> bytes:
    """RELEASE (``lease[16]``); answered by an empty RELEASE_OK. With ``check``
    (``F_RELEASE_CHECK``) the answer's ``F_RELEASE_LIVE`` says whether the lease was still
    live, and a lease that is over is no error."""
    if len(lease) != HASH_BYTES:
        raise InvalidInput(f"a lease id is {HASH_BYTES} bytes")
    flags = F_RELEASE_CHECK if check else 0
    return encode_header(Op.RELEASE, request_id, HASH_BYTES, flags) + lease


def decode_release(data: bytes) -> bytes:
    if len(data) != HASH_BYTES:
        raise FrameError(f"RELEASE: the body is a {HASH_BYTES}-byte lease id")
    return bytes(data)


def encode_release_ok(request_id: int, *, live: bool = False) -> bytes:
    return encode_header(Op.RELEASE_OK, request_id, 0, F_RELEASE_LIVE if live else 0)


_ERROR = struct.Struct("<H")


class ErrorFrame(NamedTuple):
    """ERROR (``code:u16`` + a UTF-8 message): see ``errors.ErrorCode``; with
    ``F_ERROR_CLOSING`` the node closes the connection after it."""

    code: int
    message: str
    closing: bool = False


def encode_error(request_id: int, error: ErrorFrame, *, version: int = VERSION) -> bytes:
    """An ERROR frame; ``version``: the peer's, when refusing a peer of another version (an
    ERROR's layout is the same in every version, so its peer can read why)."""
    message = error.message.encode("utf-8", "replace")[:MAX_MESSAGE]
    body = _ERROR.pack(error.code) + message
    flags = F_ERROR_CLOSING if error.closing else 0
    return encode_header(Op.ERROR, request_id, len(body), flags, version=version) + body


def decode_error(data: bytes, flags: int) -> ErrorFrame:
    if len(data) < _ERROR.size:
        raise FrameError("ERROR: body shorter than its code")
    (code,) = _ERROR.unpack_from(data)
    message = bytes(data[_ERROR.size :]).decode("utf-8", "replace")
    return ErrorFrame(code, message, bool(flags & F_ERROR_CLOSING))


# -- the same-host path: SEGMENTS, LOCATE, STAGE, COMMIT, ABORT -------------------------------
#
# Served on the node's Unix socket only, to trusted tenants: payloads never cross the socket.
# The node's CPU tier lives in memfd segments; SEGMENTS passes their descriptors (SCM_RIGHTS),
# LOCATE says where leased blocks lie in them, STAGE hands out slots to fill, COMMIT publishes
# them. ``docs/dataplane.md``, "Same host", is the spec.

MAX_SEGMENTS = 1 << 16
"""Most segment ids one SEGMENTS request or answer lists."""
MAX_FDS = 200
"""Most descriptors one SEGMENTS_OK carries (the kernel takes 253 per message)."""

_SEGMENTS_OK = struct.Struct("<II")  # live, sent
_LOCATE_OK = struct.Struct("<16sIII4x")  # lease, lease_ms, matched, located
_SLOT = struct.Struct("<IIQQQ")  # segment, 0, offset, nbytes, checksum
_STAGE_OK = struct.Struct("<16sIBxxx")  # staging, count, durable
_STAGED = struct.Struct("<BxxxIQ")  # status, segment, offset
_COMMIT = struct.Struct("<16sII")  # staging, start, count
_COMMIT_BLOCK = struct.Struct("<QQ")  # nbytes, checksum


def encode_segments(request_id: int, wanted: Sequence[int]) -> bytes:
    """SEGMENTS (``count:u32 segment[u32 x count]``): descriptors of these segments (the ones
    the client has not mapped yet); an empty list asks only which segments are live."""
    if len(wanted) > MAX_SEGMENTS:
        raise InvalidInput(f"{len(wanted)} segments asked; at most {MAX_SEGMENTS}")
    body = _COUNT.pack(len(wanted)) + struct.pack(f"<{len(wanted)}I", *wanted)
    return encode_header(Op.SEGMENTS, request_id, len(body)) + body


def decode_segments(data: bytes) -> list[int]:
    if len(data) < _COUNT.size:
        raise FrameError("SEGMENTS: body shorter than its count")
    (count,) = _COUNT.unpack_from(data)
    if len(data) != _COUNT.size + 4 * count:
        raise FrameError(f"SEGMENTS: {len(data)} bytes of body for {count} segments")
    return list(struct.unpack_from(f"<{count}I", data, _COUNT.size))


class SegmentsOk(NamedTuple):
    """SEGMENTS_OK (``live:u32 sent:u32 live_ids[u32 x live] sent_ids[u32 x sent]``), with one
    descriptor per sent id, in order, in the same message (``SCM_RIGHTS``). ``live`` lists
    every segment of the tier now (a client may unmap the others: their ids never come back);
    ``sent`` those asked that are live, at most ``MAX_FDS`` (ask again for the rest)."""

    live: list[int]
    sent: list[int]


def encode_segments_ok(request_id: int, ok: SegmentsOk) -> bytes:
    ids = [*ok.live, *ok.sent]
    body = _SEGMENTS_OK.pack(len(ok.live), len(ok.sent)) + struct.pack(f"<{len(ids)}I", *ids)
    return encode_header(Op.SEGMENTS_OK, request_id, len(body)) + body


def decode_segments_ok(data: bytes) -> SegmentsOk:
    if len(data) < _SEGMENTS_OK.size:
        raise FrameError("SEGMENTS_OK: body shorter than its fixed part")
    live, sent = _SEGMENTS_OK.unpack_from(data)
    if len(data) != _SEGMENTS_OK.size + 4 * (live + sent):
        raise FrameError(f"SEGMENTS_OK: {len(data)} bytes of body for {live} + {sent} ids")
    ids = list(struct.unpack_from(f"<{live + sent}I", data, _SEGMENTS_OK.size))
    return SegmentsOk(ids[:live], ids[live:])


def encode_locate(request_id: int, lookup: Lookup) -> bytes:
    """LOCATE: a LOOKUP's body and flags (``lease_ms`` must be positive); answered by
    LOCATE_OK."""
    body = _LOOKUP.pack(lookup.root, lookup.lease_ms, len(lookup.ids)) + join_ids(lookup.ids)
    flags = lookup.flags & ~F_LOOKUP_EXPLAIN
    return _with_session(Op.LOCATE, request_id, flags, body, lookup.session_id)


def decode_locate(
    data: bytes, limits: Limits, flags: int = 0, session_id: str | None = None
) -> Lookup:
    lookup = decode_lookup(data, limits, flags & ~F_LOOKUP_EXPLAIN, session_id)
    if lookup.lease_ms == 0:
        raise InvalidInput("LOCATE: a lease is required (lease_ms > 0): it guards the slots")
    return lookup


class Slot(NamedTuple):
    """Where a block's payload lies: ``nbytes`` at ``offset`` of segment ``segment``."""

    segment: int
    offset: int
    nbytes: int
    checksum: int = 0
    """XXH3-64 (seed 0) of the payload (LOCATE_OK; 0 elsewhere)."""


class LocateOk(NamedTuple):
    """LOCATE_OK (``lease[16] lease_ms:u32 matched:u32 located:u32 pad[4]``, then per located
    block ``segment:u32 pad[4] offset:u64 nbytes:u64 checksum:u64``): the held prefix the caller
    may read (``matched`` blocks, all leased) and where its first ``located`` blocks lie in
    shared memory; blocks held only in other tiers were copied there first, and the located
    run stops where that was not possible."""

    lease: bytes | None
    lease_ms: int
    matched: int
    slots: list[Slot]


def encode_locate_ok(request_id: int, ok: LocateOk) -> bytes:
    parts = [_LOCATE_OK.pack(ok.lease or _NO_LEASE, ok.lease_ms, ok.matched, len(ok.slots))]
    parts += [_SLOT.pack(s.segment, 0, s.offset, s.nbytes, s.checksum) for s in ok.slots]
    body = b"".join(parts)
    return encode_header(Op.LOCATE_OK, request_id, len(body)) + body


def decode_locate_ok(data: bytes) -> LocateOk:
    if len(data) < _LOCATE_OK.size:
        raise FrameError("LOCATE_OK: body shorter than its fixed part")
    lease, lease_ms, matched, n = _LOCATE_OK.unpack_from(data)
    if len(data) != _LOCATE_OK.size + _SLOT.size * n or n > matched:
        raise FrameError(f"LOCATE_OK: {len(data)} bytes of body for {n} of {matched} blocks")
    slots = []
    for i in range(n):
        segment, _, offset, nbytes, checksum = _SLOT.unpack_from(
            data, _LOCATE_OK.size + _SLOT.size * i
        )
        slots.append(Slot(segment, offset, nbytes, checksum))
    return LocateOk(None if lease == _NO_LEASE else lease, lease_ms, matched, slots)


def encode_stage(request_id: int, head: StoreHead, token_bytes: bytes) -> bytes:
    """STAGE: a STORE's fixed part and tokens, no payloads (``body_len`` = fixed + tokens;
    flag ``F_STORE_PARENT`` as for STORE): slots for the blocks, to fill in shared memory."""
    if len(token_bytes) != head.token_bytes:
        raise InvalidInput(
            f"{len(token_bytes) // 4} tokens for {head.blocks} blocks of {head.block_tokens}"
        )
    flags = head.flags
    fixed = _STORE.pack(
        head.root,
        head.parent or _NO_LEASE,
        head.block_tokens,
        head.blocks,
        head.block_nbytes,
        head.ttl_ms,
        0,
    )
    return _with_session(Op.STAGE, request_id, flags, fixed + token_bytes, head.session_id)


def decode_stage_head(
    fixed: bytes, header: Header, limits: Limits, session_id: str | None = None
) -> StoreHead:
    """The fixed part of a STAGE, checked as a STORE's (its body has no payloads)."""
    root, parent, block_tokens, count, nbytes, ttl_ms, _ = _STORE.unpack(fixed)
    head = _head(header.flags, root, parent, block_tokens, count, nbytes, ttl_ms, session_id)
    if _STORE.size + head.token_bytes != header.body_len:
        raise FrameError(
            f"STAGE: body_len {header.body_len} but its head describes "
            f"{_STORE.size + head.token_bytes} bytes"
        )
    as_store = header._replace(body_len=head.body_len)
    return decode_store_head(fixed, as_store, limits, session_id)


class StageOk(NamedTuple):
    """STAGE_OK (``staging[16] count:u32 durable:u8 pad[3] ids[16 x count]``, then per block
    ``status:u8 pad[3] segment:u32 offset:u64``): each block's id as the node derived it and
    its status: ``STORED`` (a slot of ``block_nbytes`` at ``segment``/``offset`` to fill),
    ``PRESENT`` (held or being stored: nothing to write) or ``DROPPED`` (no room; so is the
    rest). The slots stay reserved until COMMIT or ABORT of ``staging``, or the connection's
    end."""

    staging: bytes
    durable: bool
    ids: list[bytes]
    status: list[BlockStatus]
    slots: list[Slot | None]


def encode_stage_ok(request_id: int, ok: StageOk) -> bytes:
    parts = [_STAGE_OK.pack(ok.staging, len(ok.ids), ok.durable), join_ids(ok.ids)]
    for status, slot in zip(ok.status, ok.slots, strict=True):
        parts.append(
            _STAGED.pack(status.code, slot.segment, slot.offset)
            if slot is not None
            else _STAGED.pack(status.code, 0, 0)
        )
    body = b"".join(parts)
    return encode_header(Op.STAGE_OK, request_id, len(body)) + body


def decode_stage_ok(data: bytes, block_nbytes: int) -> StageOk:
    if len(data) < _STAGE_OK.size:
        raise FrameError("STAGE_OK: body shorter than its fixed part")
    staging, n, durable = _STAGE_OK.unpack_from(data)
    end = _STAGE_OK.size + HASH_BYTES * n
    if len(data) != end + _STAGED.size * n:
        raise FrameError(f"STAGE_OK: {len(data)} bytes of body for {n} blocks")
    ids = split_ids(data[:end], _STAGE_OK.size, n)
    status: list[BlockStatus] = []
    slots: list[Slot | None] = []
    for i in range(n):
        code, segment, offset = _STAGED.unpack_from(data, end + _STAGED.size * i)
        (block_status,) = _statuses(bytes([code]), "STAGE_OK")
        status.append(block_status)
        stored = block_status is BlockStatus.STORED
        slots.append(Slot(segment, offset, block_nbytes) if stored else None)
    return StageOk(staging, bool(durable), ids, status, slots)


class Commit(NamedTuple):
    """COMMIT (``staging[16] start:u32 count:u32``, then per block ``nbytes:u64
    checksum:u64``): what the client wrote into the slots of blocks ``start .. start + count``
    of the staging (entries of blocks not staged are ignored). The node publishes each slot
    whose bytes have that length and XXH3-64 (seed 0). A staging is committed in order, in
    one COMMIT or several (``start`` is where the previous one ended)."""

    staging: bytes
    start: int
    nbytes: list[int]
    checksums: list[int]


def encode_commit(request_id: int, commit: Commit) -> bytes:
    n = len(commit.checksums)
    if len(commit.nbytes) != n:
        raise InvalidInput("COMMIT: one length per checksum")
    parts = [_COMMIT.pack(commit.staging, commit.start, n)]
    parts += [
        _COMMIT_BLOCK.pack(k, c) for k, c in zip(commit.nbytes, commit.checksums, strict=True)
    ]
    body = b"".join(parts)
    return encode_header(Op.COMMIT, request_id, len(body)) + body


def decode_commit(data: bytes, limits: Limits) -> Commit:
    if len(data) < _COMMIT.size:
        raise FrameError("COMMIT: body shorter than its fixed part")
    staging, start, n = _COMMIT.unpack_from(data)
    if len(data) != _COMMIT.size + _COMMIT_BLOCK.size * n:
        raise FrameError(f"COMMIT: {len(data)} bytes of body for {n} blocks")
    _check_count(n, limits, "COMMIT")
    pairs = [
        _COMMIT_BLOCK.unpack_from(data, _COMMIT.size + _COMMIT_BLOCK.size * i) for i in range(n)
    ]
    return Commit(staging, start, [p[0] for p in pairs], [p[1] for p in pairs])


def encode_commit_ok(request_id: int, ok: StoreOk) -> bytes:
    """COMMIT_OK: a STORE_OK's body; status ``REJECTED`` for a slot whose bytes did not
    match (the blocks after it are ``DROPPED``)."""
    body = _STORE_OK.pack(len(ok.ids), ok.durable) + join_ids(ok.ids) + _status_bytes(ok.status)
    return encode_header(Op.COMMIT_OK, request_id, len(body)) + body


def decode_commit_ok(data: bytes) -> StoreOk:
    try:
        return decode_store_ok(data)
    except FrameError as exc:
        raise FrameError(str(exc).replace("STORE_OK", "COMMIT_OK", 1)) from None


def encode_abort(request_id: int, staging: bytes) -> bytes:
    """ABORT (``staging[16]``): free the staging's slots; answered by an empty ABORT_OK."""
    if len(staging) != HASH_BYTES:
        raise InvalidInput(f"a staging id is {HASH_BYTES} bytes")
    return encode_header(Op.ABORT, request_id, HASH_BYTES) + staging


def decode_abort(data: bytes) -> bytes:
    if len(data) != HASH_BYTES:
        raise FrameError(f"ABORT: the body is a {HASH_BYTES}-byte staging id")
    return bytes(data)


def encode_abort_ok(request_id: int) -> bytes:
    return encode_header(Op.ABORT_OK, request_id, 0)
