"""The data plane's frames: encoding and decoding, no I/O (``docs/dataplane.md`` is the spec).

Every frame is a fixed 24-byte little-endian header and a body of ``body_len`` bytes::

    offset  size  field
         0     4  magic        b"SCDP"
         4     1  version      1
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

from sessioncache.dataplane.errors import FrameError
from sessioncache.errors import InvalidInput
from sessioncache.hashing import HASH_BYTES, Namespace

MAGIC = b"SCDP"
VERSION = 1
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

# block status in STORE_OK and COMMIT_OK (STAGE_OK: STORED means "staged, fill the slot")
STORED, PRESENT, DROPPED, REJECTED = 0, 1, 2, 3
STATUS_NAMES = ("stored", "present", "dropped", "rejected")


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


def encode_header(opcode: Op, request_id: int, body_len: int, flags: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, opcode, flags, request_id, body_len)


def decode_header(data: bytes | bytearray | memoryview, *, requests: bool) -> Header:
    """Parse and check a header: the magic, the version, and an opcode a node (``requests``)
    or a client (replies) may receive. Limits on ``body_len`` are checked by ``check_body``."""
    if len(data) != HEADER_SIZE:
        raise FrameError(f"a header is {HEADER_SIZE} bytes, got {len(data)}")
    magic, version, opcode, flags, request_id, body_len = HEADER.unpack(data)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}: not a sessioncache data-plane frame")
    if version != VERSION:
        raise FrameError(f"frame version {version}; this end speaks version {VERSION}")
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
        return _LOOKUP_OK.size + 9 * limits.max_ids
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
    """HELLO (JSON ``{"api_key": str | null, "client": str}``): the first frame of a
    connection. The node maps the key to a tenant exactly as the REST API does."""

    api_key: str | None
    client: str = ""


def encode_hello(request_id: int, hello: Hello) -> bytes:
    return _json_frame(Op.HELLO, request_id, {"api_key": hello.api_key, "client": hello.client})


def decode_hello(data: bytes) -> Hello:
    body = _json_body(data, "HELLO")
    key = body.get("api_key")
    client = body.get("client", "")
    if key is not None and not isinstance(key, str):
        raise FrameError("HELLO: api_key must be a string or null")
    if not isinstance(client, str):
        raise FrameError("HELLO: client must be a string")
    return Hello(key, client)


class HelloOk(NamedTuple):
    """HELLO_OK (JSON ``{"version", "tenant", "auth", "tiers", "max_ids", "max_block_bytes",
    "max_tokens", "max_json"}``): who the caller is and the node's limits. ``tiers`` names
    the tier indexes of LOOKUP_OK."""

    tenant: str
    auth: bool
    tiers: tuple[str, ...]
    limits: Limits


def encode_hello_ok(request_id: int, ok: HelloOk) -> bytes:
    return _json_frame(
        Op.HELLO_OK,
        request_id,
        {
            "version": VERSION,
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
        tenant, auth = body["tenant"], body["auth"]
    except (KeyError, TypeError, ValueError) as exc:
        raise FrameError(f"HELLO_OK: missing or bad field: {exc}") from None
    if not isinstance(tenant, str) or not isinstance(auth, bool):
        raise FrameError("HELLO_OK: bad tenant or auth")
    return HelloOk(tenant, auth, tiers, limits)


def namespace_json(namespace: Namespace) -> dict[str, Any]:
    return {
        "model": namespace.model,
        "block_tokens": namespace.block_tokens,
        "kv_dtype": namespace.kv_dtype,
        "kv_layout": namespace.kv_layout,
        "salt": namespace.salt,
        "lora": namespace.lora,
    }


def encode_resolve(request_id: int, namespace: Namespace) -> bytes:
    """RESOLVE (JSON namespace, as in the REST API): the caller's root of that namespace."""
    return _json_frame(Op.RESOLVE, request_id, namespace_json(namespace))


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


def encode_lookup(request_id: int, lookup: Lookup) -> bytes:
    ids = join_ids(lookup.ids)
    body = _LOOKUP.pack(lookup.root, lookup.lease_ms, len(lookup.ids)) + ids
    flags = F_LOOKUP_KEYED if lookup.keyed else 0
    return encode_header(Op.LOOKUP, request_id, len(body), flags) + body


def decode_lookup(data: bytes, limits: Limits, flags: int = 0) -> Lookup:
    if len(data) < _LOOKUP.size:
        raise FrameError("LOOKUP: body shorter than its fixed part")
    root, lease_ms, count = _LOOKUP.unpack_from(data)
    ids = split_ids(data, _LOOKUP.size, count)
    _check_count(count, limits, "LOOKUP")
    return Lookup(root, ids, lease_ms, bool(flags & F_LOOKUP_KEYED))


class Exists(NamedTuple):
    """EXISTS (``root[16] 0:u32 count:u32 ids[16 x count]``, a LOOKUP's layout): which of
    ``ids`` the node holds under ``root`` (resolved on this connection), each on its own,
    chained or keyed. Nothing is touched or leased."""

    root: bytes
    ids: list[bytes]


def encode_exists(request_id: int, *, exists: Exists) -> bytes:
    body = _LOOKUP.pack(exists.root, 0, len(exists.ids)) + join_ids(exists.ids)
    return encode_header(Op.EXISTS, request_id, len(body)) + body


def decode_exists(data: bytes, limits: Limits) -> Exists:
    lookup = decode_lookup(data, limits)
    return Exists(lookup.root, lookup.ids)


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


_NO_LEASE = bytes(HASH_BYTES)


def encode_lookup_ok(request_id: int, ok: LookupOk) -> bytes:
    n = len(ok.nbytes)
    body = b"".join(
        [
            _LOOKUP_OK.pack(ok.lease or _NO_LEASE, ok.lease_ms, n),
            struct.pack(f"<{n}Q", *ok.nbytes),
            bytes(ok.tiers),
        ]
    )
    return encode_header(Op.LOOKUP_OK, request_id, len(body)) + body


def decode_lookup_ok(data: bytes) -> LookupOk:
    if len(data) < _LOOKUP_OK.size:
        raise FrameError("LOOKUP_OK: body shorter than its fixed part")
    lease, lease_ms, n = _LOOKUP_OK.unpack_from(data)
    if len(data) != _LOOKUP_OK.size + 9 * n:
        raise FrameError(f"LOOKUP_OK: {len(data)} bytes of body for {n} blocks")
    nbytes = list(struct.unpack_from(f"<{n}Q", data, _LOOKUP_OK.size))
    tiers = list(data[_LOOKUP_OK.size + 8 * n :])
    return LookupOk(None if lease == _NO_LEASE else lease, lease_ms, nbytes, tiers)


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


class LoadIds(NamedTuple):
    """LOAD without flags (``count:u32 ids[16 x count]``): the held prefix of ``ids`` that is
    the caller's, leased only while it is sent; every block past it answers missing."""

    ids: list[bytes]
    each: bool = False
    """``F_LOAD_EACH``: every id on its own (a held block after a missing one is sent)."""


def encode_load(request_id: int, load: LoadLease | LoadIds) -> bytes:
    if isinstance(load, LoadLease):
        flags = F_LOAD_BY_LEASE | (F_LOAD_RELEASE if load.release else 0)
        body = _LOAD_LEASE.pack(load.lease, load.start, load.blocks)
    else:
        flags = F_LOAD_EACH if load.each else 0
        body = _COUNT.pack(len(load.ids)) + join_ids(load.ids)
    return encode_header(Op.LOAD, request_id, len(body), flags) + body


def decode_load(data: bytes, flags: int, limits: Limits) -> LoadLease | LoadIds:
    if flags & F_LOAD_BY_LEASE:
        if len(data) != _LOAD_LEASE.size:
            raise FrameError(f"LOAD by lease: the body is {_LOAD_LEASE.size} bytes")
        lease, start, count = _LOAD_LEASE.unpack(data)
        _check_count(count, limits, "LOAD")
        return LoadLease(lease, start, count, bool(flags & F_LOAD_RELEASE))
    if len(data) < _COUNT.size:
        raise FrameError("LOAD: body shorter than its count")
    (count,) = _COUNT.unpack_from(data)
    ids = split_ids(data, _COUNT.size, count)
    _check_count(count, limits, "LOAD")
    return LoadIds(ids, bool(flags & F_LOAD_EACH))


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
    return encode_header(Op.STORE, request_id, head.body_len, flags) + fixed + token_bytes


def decode_store_head(fixed: bytes, header: Header, limits: Limits) -> StoreHead:
    """The fixed part of a STORE, checked against the header's ``body_len`` and ``limits``."""
    root, parent, block_tokens, count, nbytes, ttl_ms, _ = _STORE.unpack(fixed)
    head = _head(header.flags, root, parent, block_tokens, count, nbytes, ttl_ms)
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
    status: list[int]


def encode_store_ok(request_id: int, ok: StoreOk) -> bytes:
    body = _STORE_OK.pack(len(ok.ids), ok.durable) + join_ids(ok.ids) + bytes(ok.status)
    return encode_header(Op.STORE_OK, request_id, len(body)) + body


def decode_store_ok(data: bytes) -> StoreOk:
    if len(data) < _STORE_OK.size:
        raise FrameError("STORE_OK: body shorter than its fixed part")
    n, durable = _STORE_OK.unpack_from(data)
    end = _STORE_OK.size + HASH_BYTES * n
    if len(data) != end + n:
        raise FrameError(f"STORE_OK: {len(data)} bytes of body for {n} blocks")
    return StoreOk(bool(durable), split_ids(data[:end], _STORE_OK.size, n), list(data[end:]))


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


def encode_error(request_id: int, error: ErrorFrame) -> bytes:
    message = error.message.encode("utf-8", "replace")[:MAX_MESSAGE]
    body = _ERROR.pack(error.code) + message
    flags = F_ERROR_CLOSING if error.closing else 0
    return encode_header(Op.ERROR, request_id, len(body), flags) + body


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
    ids = join_ids(lookup.ids)
    body = _LOOKUP.pack(lookup.root, lookup.lease_ms, len(lookup.ids)) + ids
    flags = F_LOOKUP_KEYED if lookup.keyed else 0
    return encode_header(Op.LOCATE, request_id, len(body), flags) + body


def decode_locate(data: bytes, limits: Limits, flags: int = 0) -> Lookup:
    lookup = decode_lookup(data, limits, flags)
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
    body_len = _STORE.size + len(token_bytes)
    return encode_header(Op.STAGE, request_id, body_len, flags) + fixed + token_bytes


def decode_stage_head(fixed: bytes, header: Header, limits: Limits) -> StoreHead:
    """The fixed part of a STAGE, checked as a STORE's (its body has no payloads)."""
    root, parent, block_tokens, count, nbytes, ttl_ms, _ = _STORE.unpack(fixed)
    head = _head(header.flags, root, parent, block_tokens, count, nbytes, ttl_ms)
    if _STORE.size + head.token_bytes != header.body_len:
        raise FrameError(
            f"STAGE: body_len {header.body_len} but its head describes "
            f"{_STORE.size + head.token_bytes} bytes"
        )
    as_store = header._replace(body_len=head.body_len)
    return decode_store_head(fixed, as_store, limits)


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
    status: list[int]
    slots: list[Slot | None]


def encode_stage_ok(request_id: int, ok: StageOk) -> bytes:
    parts = [_STAGE_OK.pack(ok.staging, len(ok.ids), ok.durable), join_ids(ok.ids)]
    for status, slot in zip(ok.status, ok.slots, strict=True):
        parts.append(
            _STAGED.pack(status, slot.segment, slot.offset)
            if slot is not None
            else _STAGED.pack(status, 0, 0)
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
    status: list[int] = []
    slots: list[Slot | None] = []
    for i in range(n):
        code, segment, offset = _STAGED.unpack_from(data, end + _STAGED.size * i)
        status.append(code)
        slots.append(Slot(segment, offset, block_nbytes) if code == STORED else None)
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
    body = _STORE_OK.pack(len(ok.ids), ok.durable) + join_ids(ok.ids) + bytes(ok.status)
    return encode_header(Op.COMMIT_OK, request_id, len(body)) + body


def decode_commit_ok(data: bytes) -> StoreOk:
    return decode_store_ok(data)


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
