"""The same-host frames: SEGMENTS, LOCATE, STAGE, COMMIT and ABORT (sans I/O)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

from sessioncache.dataplane.frames.blocks import (
    _COUNT,
    _LOOKUP,
    _NO_LEASE,
    _STORE,
    _STORE_OK,
    Lookup,
    StoreHead,
    StoreOk,
    _head,
    _status_bytes,
    _statuses,
    decode_lookup,
    decode_store_head,
    decode_store_ok,
    store_fixed,
)
from sessioncache.dataplane.frames.header import (
    F_LOOKUP_EXPLAIN,
    Header,
    Limits,
    Op,
    _check_count,
    _with_session,
    fixed_part,
    frame,
    join_ids,
    split_ids,
)
from sessioncache.errors import FrameError, InvalidInput
from sessioncache.hashing import HASH_BYTES
from sessioncache.status import BlockStatus

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
    return frame(Op.SEGMENTS, request_id, body)


def decode_segments(data: bytes) -> list[int]:
    (count,) = fixed_part(_COUNT, data, "SEGMENTS", "count")
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
    return frame(Op.SEGMENTS_OK, request_id, body)


def decode_segments_ok(data: bytes) -> SegmentsOk:
    live, sent = fixed_part(_SEGMENTS_OK, data, "SEGMENTS_OK")
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
    return frame(Op.LOCATE_OK, request_id, b"".join(parts))


def decode_locate_ok(data: bytes) -> LocateOk:
    lease, lease_ms, matched, n = fixed_part(_LOCATE_OK, data, "LOCATE_OK")
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
    body = store_fixed(head, token_bytes)
    return _with_session(Op.STAGE, request_id, head.flags, body, head.session_id)


def decode_stage_head(
    fixed: bytes, header: Header, limits: Limits, session_id: str | None = None
) -> StoreHead:
    """The fixed part of a STAGE, checked as a STORE's (its body has no payloads)."""
    root, parent, block_tokens, count, nbytes, ttl_ms, finish = _STORE.unpack(fixed)
    head = _head(
        header.flags, root, parent, block_tokens, count, nbytes, ttl_ms, session_id, finish
    )
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
    return frame(Op.STAGE_OK, request_id, b"".join(parts))


def decode_stage_ok(data: bytes, block_nbytes: int) -> StageOk:
    staging, n, durable = fixed_part(_STAGE_OK, data, "STAGE_OK")
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
    return frame(Op.COMMIT, request_id, b"".join(parts))


def decode_commit(data: bytes, limits: Limits) -> Commit:
    staging, start, n = fixed_part(_COMMIT, data, "COMMIT")
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
    return frame(Op.COMMIT_OK, request_id, body)


def decode_commit_ok(data: bytes) -> StoreOk:
    try:
        return decode_store_ok(data)
    except FrameError as exc:
        raise FrameError(str(exc).replace("STORE_OK", "COMMIT_OK", 1)) from None


def encode_abort(request_id: int, staging: bytes) -> bytes:
    """ABORT (``staging[16]``): free the staging's slots; answered by an empty ABORT_OK."""
    if len(staging) != HASH_BYTES:
        raise InvalidInput(f"a staging id is {HASH_BYTES} bytes")
    return frame(Op.ABORT, request_id, staging)


def decode_abort(data: bytes) -> bytes:
    if len(data) != HASH_BYTES:
        raise FrameError(f"ABORT: the body is a {HASH_BYTES}-byte staging id")
    return bytes(data)


def encode_abort_ok(request_id: int) -> bytes:
    return frame(Op.ABORT_OK, request_id, b"")
