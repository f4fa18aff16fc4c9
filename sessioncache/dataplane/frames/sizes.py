"""The longest body each opcode may have: checked from the header, before a body is read."""

from __future__ import annotations

from sessioncache.dataplane.frames.blocks import (
    _COUNT,
    _LOAD_LEASE,
    _LOOKUP,
    _LOOKUP_OK,
    _MISS,
    _STORE,
    _STORE_OK,
)
from sessioncache.dataplane.frames.control import (
    _ERROR,
)
from sessioncache.dataplane.frames.header import (
    F_LOAD_BY_LEASE,
    F_SESSION,
    MAX_MESSAGE,
    MAX_SESSION_BYTES,
    SESSION_LEN,
    SESSION_OPS,
    Header,
    Limits,
    Op,
)
from sessioncache.dataplane.frames.samehost import (
    _COMMIT,
    _COMMIT_BLOCK,
    _LOCATE_OK,
    _SEGMENTS_OK,
    _SLOT,
    _STAGE_OK,
    _STAGED,
    MAX_FDS,
    MAX_SEGMENTS,
)
from sessioncache.errors import FrameError
from sessioncache.hashing import HASH_BYTES


def max_body(header: Header, limits: Limits) -> int:
    """The longest body a frame of this opcode may have under ``limits``."""
    ids = HASH_BYTES * limits.max_ids
    op = header.opcode
    if header.flags & F_SESSION and op in SESSION_OPS:
        bare = header._replace(flags=header.flags & ~F_SESSION)
        return SESSION_LEN + MAX_SESSION_BYTES + max_body(bare, limits)
    if op in (Op.HELLO, Op.RESOLVE, Op.HELLO_OK, Op.SESSION, Op.SESSION_OK):
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
