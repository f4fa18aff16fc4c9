"""A durable tier: one checksummed file per block on a local filesystem.

Layout under ``root``::

    root/blocks/<hex[0:2]>/<hex[2:4]>/<hex>.blk     one block (``hex`` = 32 hex digits of its id)
    root/blocks/<hex[0:2]>/<hex[2:4]>/.<hex>.<random>.tmp
                                                    a put in progress (removed on open)
    root/quarantine/<hex>.<ns-time>.blk             files that failed validation, kept for study
    root/quarantine/<name>.<ns-time>.link           links planted in place of a folder or file

Every folder below ``root`` is one the tier made or found as a folder, never a link
(``tiers/folders.py``).

A block file is the 88-byte block header of ``tiers/header.py`` (block id, namespace root,
parent, payload length, payload and header checksums) with magic ``b"SCBLK\\x00\\x01\\x00"``,
followed by the payload. The file size is exactly ``88 + payload length``. The parent makes
the folder self-describing: after a restart the store rebuilds whole chains (tail-first
eviction, session re-pinning) from the files alone.

Codecs (``sessioncache.codecs``, as ``codecs.for_root`` says): the header records the codec
and raw length, the checksum covers the stored bytes, ``get`` decodes (``tiers.blockfile``).
The capacity counts stored bytes; a block adopted on the catalog's word, its raw length.

Room: ``fits`` (and a put) asks the filesystem as well as the capacity. Where the filesystem
has less room left than the budget (a smaller or shared disk), the tier's room is what it
holds plus what ``statvfs`` says is free, less ``FS_MARGIN`` (``room_bytes``): the store then
evicts by policy to make room, as for a full budget, instead of failing writes with ENOSPC.

Durability of ``put``: the header and payload go to a temp file in the block's shard folder
(no copy of the payload is made), the file is ``fdatasync``-ed, renamed over its final name and
the shard folder is ``fsync``-ed (and, the first time this process uses a folder, its parents).
When ``put`` returns the block survives ``kill -9`` and power loss (with ``fsync=False`` it
survives only the death of the process). A crash mid-put leaves at most a temp file, which the
next ``open`` deletes.

Write speed: on Linux the payload is written in 256 KiB chunks and the device write of each
chunk is started at once (``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so copying into the page
cache overlaps the disk transfer and the ``fdatasync`` waits for the tail only (measured in
docs/benchmarks.md, "Tiers").

Start-up (``DiskTier.open``) walks the shard folders, reads each block's header only (the
payload checksum is verified on every ``get``) and checks the file size; files that fail are
moved to ``quarantine/``. That costs a file open per block, minutes on a cold page cache for
a big disk; ``DiskTier.open(..., scan=False)`` opens empty instead, for an owner that knows
the blocks from elsewhere (the catalog: ``adopt``) and finds the rest later, while serving
(``scan_unindexed``: a folder walk that opens only the files it does not know). ``get``
verifies everything and quarantines on any mismatch, returning a miss rather than corrupt data.

Concurrency: one lock guards the index; all file I/O runs outside it, so puts and gets from
several threads overlap. Bytes are reserved under the lock before a put's I/O, so concurrent
puts never overshoot the capacity. An id being written, deleted or quarantined is "in flight":
other puts of it wait for that to finish, so one id never has two writers.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from itertools import repeat
from pathlib import Path
from typing import Final, TypedDict, Unpack

import torch

from sessioncache.codecs import CodecTable
from sessioncache.errors import InvalidInput, PayloadSizeError, TierFull
from sessioncache.hashing import HASH_BYTES, BlockHash
from sessioncache.tiers.base import PutItem, RecoveredBatch, RecoveredBlock
from sessioncache.tiers.blockfile import (
    HEADERS,
    MAGIC,
    Encoded,
    Entry,
    RootBytes,
    TrustedEntry,
    encode_item,
    os_error,
    quarantine,
    read_block,
    read_header_of,
)
from sessioncache.tiers.fileio import (
    PendingFile,
    fsync_dir,
    mtime,
    sync_and_rename,
    sync_file_range,
    write_all,
    write_with_writeback,
)
from sessioncache.tiers.folders import BLOCK_SUFFIX, BlockFolders
from sessioncache.tiers.header import (
    HEADER,
    HEADER_SIZE,
    VERSION,
    InvalidBlock,
)

__all__ = ["HEADER", "HEADER_SIZE", "MAGIC", "VERSION", "DiskTier"]

logger = logging.getLogger("sessioncache.tiers.disk")

encode_header = HEADERS.encode
decode_header = HEADERS.decode
_TMP_SUFFIX = ".tmp"
_HEX_LEN = 2 * HASH_BYTES
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_WRITE_FLAGS = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_EXCL
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_NOFOLLOW", 0)
)


FS_MARGIN = 1 << 20
"""Room the tier leaves free on its filesystem (folders, the catalog beside it)."""
_FILE_SLACK = 8 << 10
"""What a block's file takes beyond its payload: its header, the last page, its entry."""


class DiskOptions(TypedDict, total=False):
    """``DiskTier``'s keyword arguments (and defaults), which ``DiskTier.open`` passes on."""

    name: str
    fsync: bool
    codecs: CodecTable | None


class DiskTier:
    """A byte-bounded, crash-safe block store on a local filesystem (see the module docstring).

    Build one with ``DiskTier.open(...)``, which creates the folders and rebuilds the index
    from the files already there. ``DiskTier(...)`` itself touches nothing and starts with an
    empty index: blocks already on disk are not seen (a put of one of them rewrites it), and
    the folders are made on the first put.
    """

    durable: Final = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        name: str = "disk",
        fsync: bool = True,
        codecs: CodecTable | None = None,
    ) -> None:
        """``codecs``: how each namespace's blocks are stored (default: all raw)."""
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise InvalidInput("capacity_bytes must be an int")
        if capacity_bytes < 0:
            raise InvalidInput(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if not isinstance(name, str) or not name:
            raise InvalidInput("name must be a non-empty string")
        self.capacity_bytes: Final = capacity_bytes
        self.name: Final = name
        self._fsync = fsync
        self._codecs = codecs if codecs is not None else CodecTable()
        self._lock = threading.Lock()
        self._index: dict[BlockHash, Entry] = {}
        self._inflight: dict[BlockHash, threading.Event] = {}
        self._bytes = RootBytes()  # what the blocks count, in all and per namespace root
        self._reserved = 0
        self._recovered: list[RecoveredBlock] = []
        self._opened_at = time.time()
        self._missing: list[BlockHash] = []
        self._trusted: dict[tuple[int, bytes], TrustedEntry] = {}
        self.unscanned = False
        """Opened without its scan, and ``scan_unindexed`` not done yet."""
        self._unlink_quiet = partial(unlink_quiet, who=f"disk tier {name!r}")
        self.folders = BlockFolders(
            os.fspath(root), f"disk tier {name!r}", fsync=fsync, unlink=self._unlink_quiet
        )

    # ----------------------------------------------------------------------------- start-up

    @classmethod
    def open(
        cls,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        scan: bool = True,
        **options: Unpack[DiskOptions],
    ) -> DiskTier:
        """Create the folders under ``root`` if needed and rebuild the index from its files
        (``scan``; else start empty: see ``adopt`` and ``scan_unindexed``)."""
        tier = cls(root, capacity_bytes, **options)
        if scan:
            tier._prepare()
        else:
            tier.folders.make_base()
            tier.unscanned = True
        return tier

    def adopt(self, blocks: Iterable[RecoveredBlock]) -> None:
        """Index blocks whose files are taken on trust (their rows in the catalog), without
        opening them: a missing or bad file is found by its first ``get``, a miss."""
        self._adopt_trusted([(b.block_hash, b.nbytes, b.namespace_root) for b in blocks])

    def adopt_batch(self, batch: RecoveredBatch) -> None:
        """``adopt`` column by column."""
        ids, roots, sizes = batch.ids, batch.namespace_roots, batch.nbytes
        if not ids:
            return
        root, nbytes = roots[0], int(sizes[0])
        if roots.count(root) == len(roots) and (sizes == nbytes).all():
            # One size and namespace (the usual case): one entry, and the index filled by
            # C loops unless an id is already known.
            with self._lock:
                index, inflight = self._index, self._inflight
                if index.keys().isdisjoint(ids) and inflight.keys().isdisjoint(ids):
                    entry = self._trusted.get((nbytes, root))
                    if entry is None:
                        entry = self._trusted[nbytes, root] = TrustedEntry(nbytes, root)
                    size = len(index)
                    index.update(zip(ids, repeat(entry)))
                    added = nbytes * (len(index) - size)
                    self._bytes.count(root, added, added)
                    return
        self._adopt_trusted(zip(ids, sizes.tolist(), roots, strict=True))

    def _adopt_trusted(self, blocks: Iterable[tuple[BlockHash, int, bytes]]) -> None:
        trusted = self._trusted
        with self._lock:
            index, inflight = self._index, self._inflight
            for block_hash, nbytes, root in blocks:
                if block_hash in index or block_hash in inflight:
                    continue
                entry = trusted.get((nbytes, root))
                if entry is None:
                    entry = trusted[nbytes, root] = TrustedEntry(nbytes, root)
                index[block_hash] = entry
                self._bytes.count(root, nbytes, nbytes)

    def scan_unindexed(self) -> list[RecoveredBlock]:
        """Walk the folders, index the valid files the index does not know (reading their
        headers; quarantining bad ones) and return them: what ``adopt`` missed. Safe while
        the tier serves: a block being put or deleted meanwhile is left to that call, and a
        temp file is removed only if it is older than this tier (a crashed put's). The ids
        adopted on trust whose files the walk did not see are left in ``missing()``."""
        found: list[RecoveredBlock] = []
        seen: set[BlockHash] = set()
        for _, shards in self.folders.shards():
            for shard in shards:
                self._scan_shard(shard, found, known=self._index, seen=seen)
        adopted: list[RecoveredBlock] = []
        with self._lock:
            for block in found:
                if block.block_hash in self._index or block.block_hash in self._inflight:
                    continue  # put, or being put or deleted, since the walk saw it
                entry = Entry(block.nbytes, block.namespace_root, block.stored_nbytes)
                self._index[block.block_hash] = entry
                self._bytes.add(entry)
                adopted.append(block)
            self._missing = [
                block_hash
                for block_hash, entry in self._index.items()
                if type(entry) is TrustedEntry and block_hash not in seen
            ]
            self.unscanned = False
        return adopted

    def find_unindexed(self, hashes: Sequence[BlockHash]) -> list[RecoveredBlock]:
        """Until ``scan_unindexed`` has walked the folders: index the files of ``hashes``, in
        order, that the index does not know, as far as they run unbroken (reading their
        headers; a bad one is quarantined and ends the run), and return them. What a
        lookup asks for is served before the walk reaches it. Nothing once the walk is done."""
        found: list[RecoveredBlock] = []
        if not self.unscanned:
            return found
        for block_hash in hashes:
            if block_hash in self._index:
                continue
            try:
                path = self.folders.checked_path(block_hash)
                block = read_header_of(path, block_hash)
            except InvalidBlock as exc:
                self._quarantine_file(path, block_hash, str(exc))
                break
            except OSError:
                break
            with self._lock:
                if block_hash in self._inflight:
                    break
                if block_hash not in self._index:
                    entry = Entry(block.nbytes, block.namespace_root, block.stored_nbytes)
                    self._index[block_hash] = entry
                    self._bytes.add(entry)
                    found.append(block)
        return found

    def missing(self) -> list[BlockHash]:
        """The ids adopted on trust whose files the last ``scan_unindexed`` did not find;
        they are dropped from the index here, as a read would (their owner forgets them)."""
        gone: list[BlockHash] = []
        with self._lock:
            for block_hash in self._missing:
                entry = self._index.get(block_hash)
                if type(entry) is TrustedEntry and block_hash not in self._inflight:
                    del self._index[block_hash]
                    self._bytes.remove(entry)
                    gone.append(block_hash)
            self._missing = []
        return gone

    def _prepare(self) -> None:
        self.folders.make_base()
        start = time.perf_counter()
        found: list[RecoveredBlock] = []
        quarantined = 0
        for top, shards in self.folders.shards():
            for shard in shards:
                quarantined += self._scan_shard(shard, found)
            if self._fsync:
                fsync_dir(top)
            self.folders.ready.add(top)
        with self._lock:
            for block in found:
                entry = Entry(block.nbytes, block.namespace_root, block.stored_nbytes)
                self._index[block.block_hash] = entry
                self._bytes.add(entry)
            self._recovered = found
        logger.info(
            "disk tier %r at %s: recovered %d blocks (%d bytes of %d), quarantined %d, %.3fs",
            self.name,
            self.folders.root,
            len(found),
            self._bytes.used,
            self.capacity_bytes,
            quarantined,
            time.perf_counter() - start,
        )
        if self._bytes.used > self.capacity_bytes:
            logger.warning(
                "disk tier %r holds %d bytes, over its capacity of %d; nothing new fits "
                "until blocks are evicted",
                self.name,
                self._bytes.used,
                self.capacity_bytes,
            )

    def _scan_shard(
        self,
        shard: str,
        found: list[RecoveredBlock],
        known: dict[BlockHash, Entry] | None = None,
        seen: set[BlockHash] | None = None,
    ) -> int:
        """Index the valid blocks of one shard folder; returns how many were quarantined.
        With ``known`` (the live index: the tier is serving), the ids in it are skipped
        unopened, and only temp files older than this tier are removed."""
        quarantined = 0
        prefix = shard[-5:].replace(os.sep, "")  # "ab/cd" -> "abcd"
        with os.scandir(shard) as entries:
            for entry in entries:
                fname = entry.name
                if fname.startswith(".") and fname.endswith(_TMP_SUFFIX):
                    if known is None or mtime(entry.path) < self._opened_at:
                        self._unlink_quiet(entry.path)
                    continue
                if not fname.endswith(BLOCK_SUFFIX):
                    continue
                stem = fname[: -len(BLOCK_SUFFIX)]
                try:
                    block_hash = BlockHash(bytes.fromhex(stem))
                except ValueError:
                    block_hash = BlockHash(b"")
                if len(stem) != _HEX_LEN or block_hash.hex() != stem or stem[:4] != prefix:
                    logger.warning("disk tier %r: unexpected file %s, ignored", self.name, fname)
                    continue
                if known is not None and (block_hash in known or block_hash in self._inflight):
                    if seen is not None:
                        seen.add(block_hash)
                    continue
                try:
                    found.append(read_header_of(entry.path, block_hash))
                except InvalidBlock as exc:
                    self._quarantine_file(entry.path, block_hash, str(exc))
                    quarantined += 1
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    if exc.errno != errno.EIO:
                        logger.error(
                            "disk tier %r: cannot read %s, skipped: %s", self.name, fname, exc
                        )
                        continue
                    self._quarantine_file(entry.path, block_hash, f"read error: {exc}")
                    quarantined += 1
        if self._fsync:
            fsync_dir(shard)
        self.folders.ready.add(shard)
        return quarantined

    def stored_by_root(self) -> dict[bytes, tuple[int, int]]:
        """Per namespace root, the raw bytes of its blocks here and the bytes stored for
        them (``CodedTier``)."""
        with self._lock:
            return self._bytes.snapshot()

    # ------------------------------------------------------------------------------ properties

    @property
    def used_bytes(self) -> int:
        """Payload bytes of the blocks held (headers and puts in progress not counted)."""
        return self._bytes.used

    @property
    def root(self) -> Path:
        return Path(self.folders.root)

    def fits(self, nbytes: int) -> bool:
        free = self._fs_free()
        with self._lock:
            return (
                nbytes > 0
                and self._bytes.used + self._reserved + nbytes <= self.capacity_bytes
                and self._reserved + nbytes + _FILE_SLACK <= free
            )

    def room_bytes(self) -> int:
        """The bytes of blocks the tier could hold now: its capacity, or what it holds and
        what its filesystem has left (less a margin) where that is less."""
        free = self._fs_free()
        with self._lock:
            return max(0, min(self.capacity_bytes, self._bytes.used + free - self._reserved))

    def _fs_free(self) -> int:
        """The bytes its filesystem lets it write now, less ``FS_MARGIN`` (no limit where the
        folders are not made yet)."""
        try:
            st = os.statvfs(self.folders.blocks)
        except OSError:
            return 1 << 62
        return st.f_bavail * st.f_frsize - FS_MARGIN

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    def keys(self) -> list[BlockHash]:
        with self._lock:
            return list(self._index)

    def recovered(self) -> Iterator[RecoveredBlock]:
        """The blocks the start-up scan found that are still held."""
        for block in self._recovered:
            if block.block_hash in self._index:
                yield block

    def close(self) -> None:
        """Nothing to release: no file stays open between calls and no thread is started."""

    # ------------------------------------------------------------------------------------ put

    def put(self, item: PutItem) -> None:
        [error] = self.put_group([item])
        if error is not None:
            raise error

    def put_group(self, items: Sequence[PutItem]) -> list[Exception | None]:
        """Store several blocks with one round of syncs (group commit): every file is written
        with its write-back started, then each is ``fdatasync``-ed and renamed into place,
        then each shard folder is ``fsync``-ed once. Durable when this returns, as ``put``.
        Per item: None (stored, or held already) or the error ``put`` would raise
        (``TierFull``, ``TierUnavailable``, a bad argument); one item's error leaves the
        others stored."""
        results: list[Exception | None] = [None] * len(items)
        claimed: list[tuple[int, BlockHash, threading.Event, int]] = []
        encoded: dict[int, Encoded] = {}
        free = self._fs_free()  # once per group: its own claims are counted in ``_reserved``
        try:
            for i, item in enumerate(items):
                try:
                    if item.block_hash in self._index:
                        continue  # held: nothing to encode
                    coded = encode_item(item, self._codecs, self.name, self.capacity_bytes)
                    claim = self._claim(item, coded.stored.nbytes, free)
                except (TierFull, InvalidInput, PayloadSizeError) as exc:
                    results[i] = exc
                    continue
                if claim is not None:
                    encoded[i] = coded
                    claimed.append((i, item.block_hash, *claim))
            pending: list[tuple[int, PendingFile]] = []
            for i, _, _, _ in claimed:
                try:
                    pending.append((i, self._begin_file(items[i], encoded[i])))
                except OSError as exc:
                    results[i] = os_error(self.name, exc)
                except PayloadSizeError as exc:
                    results[i] = exc
            files = [p for _, p in pending]
            try:
                failed = sync_and_rename(files, fsync=self._fsync, unlink=self._unlink_quiet)
            except OSError as exc:  # a folder's fsync: none of them is known durable
                failed = dict.fromkeys(range(len(files)), exc)
            for i, error in failed.items():
                results[pending[i][0]] = os_error(self.name, error)
            for i, f in enumerate(files):
                if i not in failed:
                    self.folders.ready.update(f.new_dirs)
        finally:
            with self._lock:
                for i, block_hash, _, nbytes in claimed:
                    self._reserved -= nbytes
                    if results[i] is None:
                        coded = encoded[i]
                        stored = nbytes if coded.codec.id else -1
                        entry = Entry(coded.raw_nbytes, items[i].namespace_root, stored)
                        self._index[block_hash] = entry
                        self._bytes.add(entry)
                    del self._inflight[block_hash]
            for _, _, done, _ in claimed:
                done.set()
        return results

    def _claim(self, item: PutItem, nbytes: int, free: int) -> tuple[threading.Event, int] | None:
        """Reserve ``nbytes`` for the item and mark its id in flight; None when it is held.
        ``free``: what the filesystem had left (``_fs_free``) before the group's claims."""
        block_hash = item.block_hash
        if nbytes > self.capacity_bytes:
            raise PayloadSizeError(
                f"{self.name}: payload of {nbytes} bytes exceeds the tier's capacity of "
                f"{self.capacity_bytes}"
            )
        while True:
            with self._lock:
                if block_hash in self._index:
                    return None
                waiting = self._inflight.get(block_hash)
                if waiting is None:
                    if self._bytes.used + self._reserved + nbytes > self.capacity_bytes:
                        raise TierFull(
                            f"{self.name} tier: {nbytes} bytes do not fit "
                            f"({self._bytes.used + self._reserved} of {self.capacity_bytes} in use)"
                        )
                    if self._reserved + nbytes + _FILE_SLACK > free:
                        raise TierFull(f"{self.name} tier: filesystem full ({free} bytes left)")
                    self._reserved += nbytes
                    done = threading.Event()
                    self._inflight[block_hash] = done
                    return done, nbytes
            waiting.wait()  # another thread writes, deletes or quarantines this id

    def _begin_file(self, item: PutItem, coded: Encoded) -> PendingFile:
        """Write the block's temp file, its device write started; left open for its sync."""
        block_hash, view = item.block_hash, coded.stored
        hexid = block_hash.hex()
        shard, new_dirs = self.folders.shard_for_put(hexid)
        final = os.path.join(shard, hexid + BLOCK_SUFFIX)
        tmp = os.path.join(shard, f".{hexid}.{secrets.token_hex(6)}{_TMP_SUFFIX}")
        header = encode_header(
            block_hash,
            item.namespace_root,
            item.parent,
            view.nbytes,
            coded.checksum,
            coded.codec.id,
            coded.raw_nbytes if coded.codec.id else 0,
        )
        fd = os.open(tmp, _WRITE_FLAGS, 0o644)
        try:
            if self._fsync and sync_file_range is not None:
                write_with_writeback(fd, memoryview(header), view, sync_file_range)
            else:
                write_all(fd, [memoryview(header), view])
        except BaseException:
            os.close(fd)
            self._unlink_quiet(tmp)
            raise
        return PendingFile(fd, tmp, final, new_dirs)

    # ------------------------------------------------------------------------------------ get

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        entry = self._index.get(block_hash)
        if entry is None:
            return None
        try:
            path = self.folders.checked_path(block_hash)
            raw, stored = read_block(
                path, block_hash, entry.namespace_root, entry.nbytes, entry.stored
            )
        except FileNotFoundError:
            logger.warning("disk tier %r: block %s vanished", self.name, block_hash.hex())
            self._drop(block_hash, entry, None, "")
            return None
        except OSError as exc:
            if exc.errno != errno.EIO:
                raise
            self._drop(block_hash, entry, path, f"read error: {exc}")
            return None
        except InvalidBlock as exc:
            self._drop(block_hash, entry, path, str(exc))
            return None
        if stored != entry.stored:  # adopted on trust: it counts what it stores now
            with self._lock:
                if self._index.get(block_hash) is entry:
                    known = Entry(entry.nbytes, entry.namespace_root, stored)
                    self._bytes.remove(entry)
                    self._index[block_hash] = known
                    self._bytes.add(known)
        return torch.from_numpy(raw)

    # --------------------------------------------------------------------------------- delete

    def delete(self, block_hash: BlockHash) -> int:
        with self._lock:
            entry = self._index.pop(block_hash, None)
            if entry is None:
                return 0
            self._bytes.remove(entry)
            done = threading.Event()
            self._inflight[block_hash] = done
        try:
            self._unlink_quiet(self.folders.path(block_hash))
        finally:
            with self._lock:
                del self._inflight[block_hash]
            done.set()
        return entry.nbytes

    # -------------------------------------------------------------------------------- helpers

    def _drop(self, block_hash: BlockHash, entry: Entry, path: str | None, why: str) -> None:
        """Forget a block whose file is bad (quarantining ``path``) or gone (``path`` None).

        Only acts if the index still holds this very entry: a concurrent delete or re-put
        must not lose its (possibly new, valid) file.
        """
        with self._lock:
            if self._index.get(block_hash) is not entry:
                return
            del self._index[block_hash]
            self._bytes.remove(entry)
            if path is None:
                return
            done = threading.Event()
            self._inflight[block_hash] = done
        try:
            self._quarantine_file(path, block_hash, why)
        finally:
            with self._lock:
                del self._inflight[block_hash]
            done.set()

    def _quarantine_file(self, path: str, block_hash: bytes, why: str) -> None:
        dest = self.folders.quarantine_name(block_hash)
        quarantine(path, dest, f"disk tier {self.name!r}", block_hash, why, self._unlink_quiet)


def unlink_quiet(path: str, who: str) -> None:
    """Remove ``path``: gone already is fine, another failure is logged."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.error("%s: cannot remove %s: %s", who, path, exc)
