"""LOOKUP, EXISTS, LOAD and STORE frames, with the miss section of LOOKUP_OK (sans I/O)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

from sessioncache.dataplane.frames.header import (
    F_BLOCK_MISSING,
    F_LOAD_BY_LEASE,
    F_LOAD_EACH,
    F_LOAD_RELEASE,
    F_LOOKUP_DECLINED,
    F_LOOKUP_EXPLAIN,
    F_LOOKUP_KEYED,
    F_STORE_DURABLE,
    F_STORE_FINISH,
    F_STORE_KEYED,
    F_STORE_LINKED,
    F_STORE_PARENT,
    F_UNCOUNTED,
    KEY_WORDS,
    Header,
    Limits,
    Op,
    _check_count,
    _with_session,
    encode_header,
    finish_code,
    finish_reason,
    fixed_part,
    frame,
    join_ids,
    split_ids,
)
from sessioncache.errors import FrameError, InvalidInput
from sessioncache.hashing import HASH_BYTES
from sessioncache.status import BlockStatus

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
    declined: bool = False
    """``F_LOOKUP_DECLINED`` (version 4): the caller loads nothing; the node counts why."""

    @property
    def flags(self) -> int:
        flags = F_LOOKUP_KEYED if self.keyed else 0
        flags |= 0 if self.counted else F_UNCOUNTED
        flags |= F_LOOKUP_DECLINED if self.declined else 0
        return flags | (F_LOOKUP_EXPLAIN if self.explain else 0)


def encode_lookup(request_id: int, lookup: Lookup) -> bytes:
    body = _LOOKUP.pack(lookup.root, lookup.lease_ms, len(lookup.ids)) + join_ids(lookup.ids)
    return _with_session(Op.LOOKUP, request_id, lookup.flags, body, lookup.session_id)


def decode_lookup(
    data: bytes, limits: Limits, flags: int = 0, session_id: str | None = None
) -> Lookup:
    """A LOOKUP's body (after its session section, whose id the server read already)."""
    root, lease_ms, count = fixed_part(_LOOKUP, data, "LOOKUP")
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
        bool(flags & F_LOOKUP_DECLINED),
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
    return frame(Op.EXISTS, request_id, body, flags)


def decode_exists(data: bytes, limits: Limits, flags: int = 0) -> Exists:
    lookup = decode_lookup(data, limits)
    return Exists(lookup.root, lookup.ids, not flags & F_UNCOUNTED)


def encode_exists_ok(request_id: int, held: Sequence[bool]) -> bytes:
    """EXISTS_OK (``count:u32 held[u8 x count]``): 1 for each id held under the root."""
    body = _COUNT.pack(len(held)) + bytes(1 if h else 0 for h in held)
    return frame(Op.EXISTS_OK, request_id, body)


def decode_exists_ok(data: bytes) -> list[bool]:
    (count,) = fixed_part(_COUNT, data, "EXISTS_OK", "count")
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
MISS_REASONS = ("diverged", "evicted", "expired", "new", "declined")
"""Reason codes of a miss section, in order (``attribution.REASONS``). A connection of a
version before ``DECLINED_VERSION`` carries the first four: no ``declined`` code nor count."""
MISS_PRESSURES = ("capacity", "pin_budget")
_NONE = 0xFF
_NO_INDEX = 0xFFFFFFFF
# flags (1: a first cause), reason, pressure, tier, block, token, offset, ago_s; then tokens
_MISS_HEAD = "<BBBBIIId"
_MISS_SIZES = {n: struct.Struct(f"{_MISS_HEAD}{n}Q") for n in (4, len(MISS_REASONS))}
"""The miss section with four counts (versions 2 and 3) or five (version 4: ``declined``)."""
_MISS = _MISS_SIZES[len(MISS_REASONS)]
"""The longest miss section."""


class Miss(NamedTuple):
    """The miss section of a LOOKUP_OK (``F_LOOKUP_EXPLAIN``): ``has_first:u8 reason:u8
    pressure:u8 tier:u8 block:u32 token:u32 offset:u32 ago_s:f64``, then one ``u64`` of
    missed tokens per reason of ``MISS_REASONS`` (the first four on a connection of a version
    before ``DECLINED_VERSION``: ``tokens`` has four or five). Absent values are ``0xff``
    (codes, tier), ``0xffffffff`` (offset) and NaN (``ago_s``). ``tier`` indexes HELLO_OK's
    tiers. The REST API's ``miss`` object, in binary (docs/prompt-stability.md)."""

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
    layout = _MISS_SIZES.get(len(miss.tokens))
    if layout is None:
        raise InvalidInput(f"a miss section has 4 or 5 counts, not {len(miss.tokens)}")
    return layout.pack(
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
    layout = _MISS_SIZES[4] if len(data) - offset == _MISS_SIZES[4].size else _MISS
    first, reason, pressure, tier, block, token, off, ago, *tokens = layout.unpack_from(
        data, offset
    )
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
    return frame(Op.LOOKUP_OK, request_id, b"".join(parts))


def decode_lookup_ok(data: bytes) -> LookupOk:
    lease, lease_ms, n = fixed_part(_LOOKUP_OK, data, "LOOKUP_OK")
    end = _LOOKUP_OK.size + 9 * n
    if len(data) not in (end, *(end + m.size for m in _MISS_SIZES.values())):
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
    (count,) = fixed_part(_COUNT, data, "LOAD", "count")
    ids = split_ids(data, _COUNT.size, count)
    _check_count(count, limits, "LOAD")
    return LoadIds(ids, bool(flags & F_LOAD_EACH), session_id)


def block_header(request_id: int, nbytes: int, *, missing: bool = False) -> bytes:
    """BLOCK: the payload of one block (body = its bytes), in the order asked; with
    ``F_BLOCK_MISSING`` and an empty body when the block is not held."""
    return encode_header(Op.BLOCK, request_id, nbytes, F_BLOCK_MISSING if missing else 0)


# -- STORE ---------------------------------------------------------------------------------

_STORE = struct.Struct("<16s16sIIQIB3x")
# root, parent, block_tokens, count, nbytes, ttl_ms, finish (a code; 0: none), pad


class StoreHead(NamedTuple):
    """STORE (``root[16] parent[16] block_tokens:u32 blocks:u32 block_nbytes:u64 ttl_ms:u32
    finish:u8 pad[3]``, then ``blocks x block_tokens`` tokens as ``u32``, then ``blocks``
    payloads of ``block_nbytes`` each): a chain segment continuing from ``parent`` (with
    ``F_STORE_PARENT``; else from ``root``, and ``parent`` is zeros). The node derives each
    block's id from its parent and tokens; ``ttl_ms`` 0 is the node's default TTL; ``finish``
    is read only with ``F_STORE_FINISH`` (``finish_reason``)."""

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
    durable: bool = False
    """``F_STORE_DURABLE``: answered once every block is on the durable tier."""
    finish_reason: str | None = None
    """``F_STORE_FINISH`` (with a session): the request whose KV this is has finished, for
    this reason (one of ``FINISH_REASONS``, sent as its code in the ``finish`` byte)."""

    @property
    def flags(self) -> int:
        flags = F_STORE_PARENT if self.parent is not None else 0
        if self.keyed:
            flags |= F_STORE_KEYED | (F_STORE_LINKED if self.linked else 0)
        if self.durable:
            flags |= F_STORE_DURABLE
        if self.finish_reason is not None:
            flags |= F_STORE_FINISH
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
    finish: int = 0,
) -> StoreHead:
    keyed = bool(flags & F_STORE_KEYED)
    if keyed and block_tokens != KEY_WORDS:
        raise InvalidInput(
            f"a keyed STORE carries {HASH_BYTES}-byte keys: block_tokens must be {KEY_WORDS}"
        )
    reason = None
    if flags & F_STORE_FINISH:
        reason = finish_reason(finish)
        _check_finish_session(reason, session_id)
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
        bool(flags & F_STORE_DURABLE),
        reason,
    )


def _check_finish_session(reason: str | None, session_id: str | None) -> None:
    if reason is not None and session_id is None:
        raise InvalidInput(
            "a finish reason is a session's request's: a STORE or STAGE with F_STORE_FINISH "
            "must name a session (F_SESSION)"
        )


def store_fixed(head: StoreHead, token_bytes: bytes) -> bytes:
    """The fixed part of a STORE or STAGE and its tokens, checked to be ``head``'s."""
    if len(token_bytes) != head.token_bytes:
        raise InvalidInput(
            f"{len(token_bytes) // 4} tokens for {head.blocks} blocks of {head.block_tokens}"
        )
    _check_finish_session(head.finish_reason, head.session_id)
    fixed = _STORE.pack(
        head.root,
        head.parent or _NO_LEASE,
        head.block_tokens,
        head.blocks,
        head.block_nbytes,
        head.ttl_ms,
        finish_code(head.finish_reason) if head.finish_reason is not None else 0,
    )
    return fixed + token_bytes


def encode_store_head(request_id: int, head: StoreHead, token_bytes: bytes) -> bytes:
    """Header, fixed part and tokens of a STORE; the payloads follow, ``count`` of them."""
    payloads = head.blocks * head.block_nbytes
    body = store_fixed(head, token_bytes)
    return _with_session(Op.STORE, request_id, head.flags, body, head.session_id, payloads)


def decode_store_head(
    fixed: bytes, header: Header, limits: Limits, session_id: str | None = None
) -> StoreHead:
    """The fixed part of a STORE, checked against ``limits`` and the header's ``body_len``
    (what follows the session section)."""
    root, parent, block_tokens, count, nbytes, ttl_ms, finish = _STORE.unpack(fixed)
    head = _head(
        header.flags, root, parent, block_tokens, count, nbytes, ttl_ms, session_id, finish
    )
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
    return frame(Op.STORE_OK, request_id, body)


def decode_store_ok(data: bytes) -> StoreOk:
    n, durable = fixed_part(_STORE_OK, data, "STORE_OK")
    end = _STORE_OK.size + HASH_BYTES * n
    if len(data) != end + n:
        raise FrameError(f"STORE_OK: {len(data)} bytes of body for {n} blocks")
    ids = split_ids(data[:end], _STORE_OK.size, n)
    return StoreOk(bool(durable), ids, _statuses(data[end:], "STORE_OK"))
