"""File I/O for the disk tier: whole writes and reads over ``writev``/``readv``, a directory's
fsync, and writing back a payload's chunks while the next is copied (``sync_file_range`` on
Linux; "Write speed" in ``tiers/disk.py``'s docstring)."""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


def fsync_dir(path: str) -> None:
    fd = os.open(path, _DIR_FLAGS)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, buffers: list[memoryview]) -> None:
    """``writev`` every byte of ``buffers``, resuming after short writes."""
    while buffers:
        done = os.writev(fd, buffers)
        while buffers and done >= buffers[0].nbytes:
            done -= buffers[0].nbytes
            buffers.pop(0)
        if done:
            buffers[0] = buffers[0][done:]


def load_sync_file_range() -> Callable[[int, int, int], None] | None:
    """Linux ``sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)``, or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def start_writeback(fd: int, offset: int, nbytes: int) -> None:
        fn(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE; a failure only loses the overlap

    return start_writeback


sync_file_range = load_sync_file_range()
# See "Write speed" in tiers/disk.py's docstring.
WRITEBACK_CHUNK = 256 << 10


def write_with_writeback(
    fd: int, header: memoryview, view: memoryview, start: Callable[[int, int, int], None]
) -> None:
    """Write header and payload in chunks, starting the device write of each chunk at once.

    The disk then writes chunk ``i`` while the next one is copied into the page cache, so the
    ``fdatasync`` that follows waits for the tail only instead of the whole payload.
    """
    step = WRITEBACK_CHUNK
    write_all(fd, [header, view[:step]])
    written = header.nbytes + min(step, view.nbytes)
    start(fd, 0, written)
    for pos in range(step, view.nbytes, step):
        chunk = view[pos : pos + step]
        write_all(fd, [chunk])
        start(fd, written, chunk.nbytes)
        written += chunk.nbytes


def read_full(fd: int, buffers: list[memoryview]) -> int:
    """``readv`` into ``buffers`` until they are full or EOF; returns the bytes read."""
    total = 0
    buffers = [b for b in buffers if b.nbytes]
    while buffers:
        got = os.readv(fd, buffers)
        if got == 0:
            break
        total += got
        while buffers and got >= buffers[0].nbytes:
            got -= buffers[0].nbytes
            buffers.pop(0)
        if got:
            buffers[0] = buffers[0][got:]
    return total


def mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except FileNotFoundError:
        return float("inf")  # gone: nothing to remove


@dataclass(frozen=True, slots=True)
class PendingFile:
    """A file written to ``tmp``, still open, to be synced and renamed to ``final``;
    ``new_dirs``: folders made for it whose entries in their parents are not durable yet."""

    fd: int
    tmp: str
    final: str
    new_dirs: list[str]


def sync_and_rename(
    files: list[PendingFile], *, fsync: bool, unlink: Callable[[str], None]
) -> dict[int, OSError]:
    """Group commit: ``fdatasync`` and close each file, rename each into place, then ``fsync``
    each folder once (and the parents of new folders). A file appears under its name only
    once synced. The errors by position (a failed file's temp file is removed)."""
    errors: dict[int, OSError] = {}
    for i, f in enumerate(files):
        try:
            if fsync:
                os.fdatasync(f.fd)
        except OSError as exc:
            errors[i] = exc
        finally:
            os.close(f.fd)
        if i not in errors:
            try:
                os.rename(f.tmp, f.final)
            except OSError as exc:
                errors[i] = exc
        if i in errors:
            unlink(f.tmp)
    if fsync:
        done = [f for i, f in enumerate(files) if i not in errors]
        for folder in dict.fromkeys(os.path.dirname(f.final) for f in done):
            fsync_dir(folder)
        # A folder made (or first seen) by this process: make its entry in its parent durable
        # too. Done after the folders' fsyncs, whose journal commit usually already carried
        # these entries, so these calls are cheap.
        for path in dict.fromkeys(p for f in done for p in f.new_dirs):
            fsync_dir(os.path.dirname(path))
    return errors
