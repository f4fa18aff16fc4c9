"""One block file of the disk tier, read and written (``tiers.disk`` keeps the index, the
capacity and the files' lifecycle): the payload as its namespace's codec stores it, the
header of a file read at start-up, and a file a codec wrote, read back and decoded."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from sessioncache.codecs import RAW, Codec, CodecTable, decode_block, encode_or_raw
from sessioncache.errors import InvalidInput, TierFull, TierUnavailable
from sessioncache.hashing import BlockHash, payload_checksum
from sessioncache.tiers.base import PutItem, RecoveredBlock
from sessioncache.tiers.fileio import read_full
from sessioncache.tiers.header import HEADER_SIZE, Header, HeaderCodec, InvalidBlock, check_id
from sessioncache.tiers.payload import as_memoryview, checked_nbytes

logger = logging.getLogger("sessioncache.tiers.disk")

MAGIC = b"SCBLK\x00\x01\x00"
HEADERS = HeaderCodec(MAGIC)
_NO_SPACE = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)


@dataclass(frozen=True, slots=True, eq=False)
class Entry:
    """One held block: what ``get`` checks its file against. Compared by identity to detect
    concurrent replacement, so each put makes its own. ``nbytes`` is the block's (raw)
    length; ``stored`` the file's payload length where a codec made it another (-1: the
    same, or not known: an adopted block counts its raw length until it is written again)."""

    nbytes: int
    namespace_root: bytes
    stored: int = -1

    @property
    def counted(self) -> int:
        """What the block counts against the capacity."""
        return self.nbytes if self.stored < 0 else self.stored


@dataclass(frozen=True, slots=True, eq=False)
class TrustedEntry(Entry):
    """A block indexed on its owner's word (``adopt``), its file not seen yet. One object is
    shared by every adopted block of a size and namespace (a restart adopts them by the
    hundred thousand): the identity check still tells a put's entry (always new) from it."""


class RootBytes:
    """What a tier's blocks count against its capacity (``used``), and per namespace root
    the raw bytes of the blocks held and the bytes stored for them. Not locked: its tier's
    lock guards it."""

    def __init__(self) -> None:
        self.used = 0
        self._totals: dict[bytes, list[int]] = {}

    def add(self, entry: Entry) -> None:
        self.count(entry.namespace_root, entry.nbytes, entry.counted)

    def remove(self, entry: Entry) -> None:
        self.count(entry.namespace_root, -entry.nbytes, -entry.counted)

    def count(self, root: bytes, raw: int, stored: int) -> None:
        self.used += stored
        totals = self._totals.get(root)
        if totals is None:
            totals = self._totals[root] = [0, 0]
        totals[0] += raw
        totals[1] += stored
        if totals[0] <= 0:
            del self._totals[root]

    def snapshot(self) -> dict[bytes, tuple[int, int]]:
        return {root: (raw, stored) for root, (raw, stored) in self._totals.items()}


def os_error(name: str, exc: OSError) -> Exception:
    """What a put answers for a file it could not write."""
    if exc.errno in _NO_SPACE:
        return TierFull(f"{name} tier: filesystem full: {exc}")
    # out of descriptors, an I/O error: not written, not a crash
    return TierUnavailable(f"{name} tier: cannot write a block: {exc}")


def quarantine(
    path: str, dest: str, who: str, block_hash: bytes, why: str, unlink: Callable[[str], None]
) -> None:
    """Move a bad block file aside to ``dest`` (deleted where it cannot be moved)."""
    try:
        os.rename(path, dest)
    except FileNotFoundError:
        return
    except OSError as exc:
        logger.error("%s: cannot quarantine %s (%s): %s; deleting it", who, path, why, exc)
        unlink(path)
        return
    logger.warning("%s: block %s is corrupt (%s); moved to %s", who, block_hash.hex(), why, dest)


class Encoded(NamedTuple):
    """A payload as the tier stores it."""

    codec: Codec
    stored: memoryview
    raw_nbytes: int
    checksum: int
    """Of the stored bytes."""


def encode_item(item: PutItem, codecs: CodecTable, tier: str, capacity: int) -> Encoded:
    """``item``'s payload as its namespace's codec stores it, with the checksum of the stored
    bytes (the item's own when raw and known); its ids and size checked."""
    check_id(item.block_hash, "block id")
    check_id(item.namespace_root, "namespace root")
    if item.parent is not None:
        check_id(item.parent, "parent id")
    checked_nbytes(item.payload, tier, capacity)
    codec = codecs.for_root(item.namespace_root)
    view = as_memoryview(item.payload)
    if codec.id == RAW.id:
        checksum = payload_checksum(view) if item.checksum is None else item.checksum
        return Encoded(RAW, view, view.nbytes, checksum)
    used, stored = encode_or_raw(codec, view)
    if used.id == RAW.id:
        checksum = payload_checksum(view) if item.checksum is None else item.checksum
        return Encoded(RAW, view, view.nbytes, checksum)
    return Encoded(used, stored, view.nbytes, payload_checksum(stored))


def open_block(path: str) -> int:
    """A block file opened for reading; a symbolic link in its place is never followed: it
    is an ``InvalidBlock`` (quarantined as a damaged file is)."""
    try:
        return os.open(path, _READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InvalidBlock("a symbolic link, not a block file") from None
        raise


def read_header_of(path: str, block_hash: BlockHash) -> RecoveredBlock:
    """What a block file's header says of it (its size checked); ``InvalidBlock``."""
    fd = open_block(path)
    try:
        raw = os.pread(fd, HEADER_SIZE, 0)
        size = os.fstat(fd)
    finally:
        os.close(fd)
    header = HEADERS.decode(raw)
    if header.block_hash != block_hash:
        raise InvalidBlock("block id in header does not match the file name")
    nbytes = header.nbytes
    if nbytes == 0 or size.st_size != HEADER_SIZE + nbytes:
        raise InvalidBlock(f"file is {size.st_size} bytes, header says {HEADER_SIZE + nbytes}")
    return RecoveredBlock(
        block_hash,
        header.namespace_root,
        header.raw_nbytes,
        size.st_mtime,
        header.parent,
        stored_nbytes=nbytes if header.codec else -1,
    )


def read_block(
    path: str, block_hash: BlockHash, namespace_root: bytes, raw_nbytes: int, stored_nbytes: int
) -> tuple[npt.NDArray[np.uint8], int]:
    """A block file's block (``raw_nbytes`` long), checked against its header and checksum,
    and the payload length its codec stored (-1: raw). ``stored_nbytes``: that length where
    known (-1: raw, or not known: a block adopted on trust, read as raw unless its header
    says a codec wrote it). Raises ``InvalidBlock`` for a file that does not hold,
    ``OSError`` where it cannot be read."""
    if stored_nbytes >= 0:
        return read_coded(
            path, block_hash, namespace_root, raw_nbytes, stored_nbytes
        ), stored_nbytes
    head, buf, got = _read_file(path, raw_nbytes)
    if head.block_hash != block_hash:
        raise InvalidBlock("block id in header does not match the file name")
    if head.namespace_root != namespace_root:
        raise InvalidBlock("namespace root in header does not match the index")
    if head.raw_nbytes != raw_nbytes:
        raise InvalidBlock(f"a block of {head.raw_nbytes} bytes, {raw_nbytes} expected")
    if head.codec:  # adopted on trust, and a codec wrote it
        return read_coded(path, block_hash, namespace_root, raw_nbytes, head.nbytes), head.nbytes
    if got != HEADER_SIZE + head.nbytes:
        raise InvalidBlock(f"file holds {got} bytes, expected {HEADER_SIZE + raw_nbytes}")
    if payload_checksum(buf.data) != head.checksum:
        raise InvalidBlock("payload checksum mismatch")
    return buf, -1


def _read_file(path: str, nbytes: int) -> tuple[Header, npt.NDArray[np.uint8], int]:
    """A block file read in one go: its header, decoded but not checked, the first ``nbytes``
    of its payload, and how many bytes were read (one more than the header and ``nbytes``
    where the file is longer)."""
    header = bytearray(HEADER_SIZE)
    # numpy, not torch.empty: numpy asks for huge pages on big buffers, which made faulting
    # in a fresh 32 MiB buffer ~3x cheaper here.
    payload = np.empty(nbytes, dtype=np.uint8)
    extra = bytearray(1)  # catches a file longer than it should be
    fd = open_block(path)
    try:
        got = read_full(fd, [memoryview(header), payload.data, memoryview(extra)])
    finally:
        os.close(fd)
    return HEADERS.decode(header), payload, got


def read_coded(
    path: str, block_hash: BlockHash, namespace_root: bytes, raw_nbytes: int, stored_nbytes: int
) -> npt.NDArray[np.uint8]:
    """The block of a file a codec wrote (``stored_nbytes`` of payload): read, checked
    against its header and checksum, decoded into its ``raw_nbytes``. Raises
    ``InvalidBlock`` for a file that does not hold, ``OSError`` where it cannot be read."""
    head, stored, got = _read_file(path, stored_nbytes)
    if head.block_hash != block_hash or head.namespace_root != namespace_root:
        raise InvalidBlock("block id or namespace root in header does not match")
    if head.raw_nbytes != raw_nbytes or not head.codec:
        raise InvalidBlock(f"a block of {head.raw_nbytes} bytes, {raw_nbytes} expected")
    if head.nbytes != stored_nbytes or got != HEADER_SIZE + stored_nbytes:
        raise InvalidBlock(f"file holds {got} bytes, expected {HEADER_SIZE + head.nbytes}")
    if payload_checksum(stored.data) != head.checksum:
        raise InvalidBlock("payload checksum mismatch")
    try:
        return decode_block(head.codec, stored.data, head.raw_nbytes)
    except InvalidInput as exc:
        raise InvalidBlock(f"cannot decode: {exc}") from None
