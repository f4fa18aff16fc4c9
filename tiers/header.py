"""The 88-byte header in front of every stored block payload: a disk tier file, a Redis value.

One layout for both; each format has its own magic (``HeaderCodec(magic)``). Fields,
little-endian (``struct`` format ``<8sHHI16s16s16sQQQ``):

    offset  size  field
         0     8  magic            the format's (``tiers.disk.MAGIC``, ``tiers.redis.MAGIC``)
         8     2  version          u16: 1 (raw), 2 (a codec's payload: a reader before
                                   codecs refuses it instead of serving its bytes)
        10     2  flags            u16, bit 0: the block has a parent (else it roots a chain);
                                   bits 8-15: the payload's codec (``sessioncache.codecs``,
                                   0: raw, the bytes as the engine sent them)
        12     4  raw length       u32, the block's length once decoded (0 when raw: the
                                   payload length)
        16    16  block id         the 16-byte ``BlockHash``
        32    16  namespace root   16 bytes
        48    16  parent id        the parent's ``BlockHash``, zeros when flag bit 0 is clear
        64     8  payload length   u64, bytes following the header (as stored)
        72     8  payload xxh3     u64, ``hashing.payload_checksum`` of the stored bytes
                                   (XXH3-64, seed 0)
        80     8  header xxh3      u64, XXH3-64 (seed 0) of ``header[0:80]``

Headers written before codecs existed (version 1) have both fields 0: raw.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

from sessioncache.errors import InvalidInput
from sessioncache.hashing import HASH_BYTES, BlockHash

__all__ = [
    "HEADER",
    "HEADER_SIZE",
    "VERSION",
    "Header",
    "HeaderCodec",
    "InvalidBlock",
    "check_id",
]

VERSION = 1
CODED_VERSION = 2
"""The version of a header whose payload a codec wrote."""
HEADER = struct.Struct("<8sHHI16s16s16sQQQ")
HEADER_SIZE = HEADER.size  # 88
_HEADER_BODY = HEADER_SIZE - 8  # the bytes the header checksum covers
_HAS_PARENT = 1
_NO_PARENT = bytes(HASH_BYTES)
_header_sum = xxhash.xxh3_64_intdigest  # 80 bytes: holding the GIL costs less than a release


class InvalidBlock(Exception):
    """A stored block failed validation (internal to the tiers: it becomes a miss, and the
    block is deleted or quarantined)."""


class Header(NamedTuple):
    """What a header says of its block."""

    block_hash: bytes
    namespace_root: bytes
    parent: BlockHash | None
    nbytes: int
    """Payload length."""
    checksum: int
    """``hashing.payload_checksum`` of the payload (as stored)."""
    codec: int = 0
    """The payload's codec id (0: raw)."""
    raw_nbytes: int = 0
    """The block's length once decoded (``nbytes`` when raw)."""


class HeaderCodec:
    """Encodes and verifies the header of one format, told apart by its 8-byte ``magic``."""

    __slots__ = ("magic",)

    def __init__(self, magic: bytes) -> None:
        if len(magic) != 8:
            raise ValueError(f"a header magic is 8 bytes, got {magic!r}")
        self.magic = magic

    def encode(
        self,
        block_hash: bytes,
        namespace_root: bytes,
        parent: bytes | None,
        nbytes: int,
        checksum: int,
        codec: int = 0,
        raw_nbytes: int = 0,
    ) -> bytes:
        """The 88-byte header of a block: ``nbytes`` stored bytes with ``checksum``, of
        ``codec`` (a block of ``raw_nbytes`` once decoded) when it is not raw."""
        if not 0 <= codec <= 0xFF or not 0 <= raw_nbytes <= 0xFFFFFFFF:
            raise InvalidInput(f"a codec id of {codec} and a raw length of {raw_nbytes}")
        body = HEADER.pack(
            self.magic,
            CODED_VERSION if codec else VERSION,
            (0 if parent is None else _HAS_PARENT) | (codec << 8),
            raw_nbytes if codec else 0,
            block_hash,
            namespace_root,
            parent or _NO_PARENT,
            nbytes,
            checksum,
            0,
        )
        return body[:_HEADER_BODY] + struct.pack("<Q", _header_sum(body[:_HEADER_BODY]))

    def decode(self, raw: bytes | bytearray | memoryview) -> Header:
        """Parse and verify a header (the payload checksum is the caller's to check); raises
        ``InvalidBlock``."""
        if len(raw) < HEADER_SIZE:
            raise InvalidBlock(f"truncated header ({len(raw)} of {HEADER_SIZE} bytes)")
        magic, version, flags, raw_len, bid, ns, parent, nbytes, checksum, hsum = (
            HEADER.unpack_from(raw)
        )
        if magic != self.magic:
            raise InvalidBlock("bad magic")
        if _header_sum(memoryview(raw)[:_HEADER_BODY]) != hsum:
            raise InvalidBlock("header checksum mismatch")
        if version not in (VERSION, CODED_VERSION):
            raise InvalidBlock(f"unsupported format version {version}")
        codec = flags >> 8
        if (
            (codec == 0) != (raw_len == 0)
            or (codec != 0) != (version == CODED_VERSION)
            or (flags & 0xFE)
        ):
            raise InvalidBlock(f"bad flags {flags:#x} or raw length {raw_len}")
        return Header(
            bid,
            ns,
            BlockHash(parent) if flags & _HAS_PARENT else None,
            nbytes,
            checksum,
            codec,
            raw_len if codec else nbytes,
        )


def check_id(value: object, what: str) -> BlockHash:
    """``value`` as a ``BlockHash`` if it is 16 bytes (a block id, namespace root or parent);
    raises ``InvalidInput`` otherwise."""
    if not isinstance(value, bytes) or len(value) != HASH_BYTES:
        raise InvalidInput(f"{what} must be {HASH_BYTES} bytes, got {value!r:.80}")
    return BlockHash(value)
