"""The binary framing of a batch block read (``POST /v1/blocks/batch``), shared by the server
and the connector so that the format has one home::

    b"SCB1"  u32 count                                   (little-endian throughout)
    count times:  16-byte id  u8 status  u64 length  payload[length]
        status 0: found, the payload follows; status 1: not found (length 0)

Records come in the order the ids were asked for.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator

from sessioncache.errors import InvalidInput

BATCH_MEDIA_TYPE = "application/x-sessioncache-blocks"
MAGIC = b"SCB1"
_HEAD = struct.Struct("<4sI")
_RECORD = struct.Struct("<16sBQ")
FOUND, MISSING = 0, 1


def batch_head(count: int) -> bytes:
    return _HEAD.pack(MAGIC, count)


def batch_record(block_id: bytes, payload: bytes | None) -> bytes:
    if payload is None:
        return _RECORD.pack(block_id, MISSING, 0)
    return _RECORD.pack(block_id, FOUND, len(payload)) + payload


def encode_batch(records: Iterable[tuple[bytes, bytes | None]]) -> Iterator[bytes]:
    items = list(records)
    yield batch_head(len(items))
    for block_id, payload in items:
        yield batch_record(block_id, payload)


def decode_batch(data: bytes | bytearray | memoryview) -> list[tuple[bytes, bytes | None]]:
    """Parse a whole batch body; a truncated or malformed body raises ``InvalidInput``."""
    view = memoryview(data)
    if len(view) < _HEAD.size:
        raise InvalidInput("truncated block batch")
    magic, count = _HEAD.unpack_from(view, 0)
    if magic != MAGIC:
        raise InvalidInput("not a sessioncache block batch")
    out: list[tuple[bytes, bytes | None]] = []
    offset = _HEAD.size
    for _ in range(count):
        if offset + _RECORD.size > len(view):
            raise InvalidInput("truncated block batch")
        block_id, status, length = _RECORD.unpack_from(view, offset)
        offset += _RECORD.size
        if status == FOUND:
            if offset + length > len(view):
                raise InvalidInput("truncated block batch")
            out.append((block_id, bytes(view[offset : offset + length])))
            offset += length
        else:
            out.append((block_id, None))
    return out
