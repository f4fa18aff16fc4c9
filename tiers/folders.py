"""The disk tier's folders under its root, a closed world.

Below ``root`` (the operator's path, followed as given) every folder is one the tier made or
found as a folder: a symbolic link, or a file, in a folder's place is moved to quarantine (the
link, not what it points to) and never followed, whether a put makes the folder, a read goes
through it or the start-up walk meets it. Block files themselves are opened with
``O_NOFOLLOW`` (``tiers/blockfile.py``), so a linked file is a damaged one. A shard folder is
checked once (``lstat`` of its two levels), the first time the tier writes or reads there.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator

from sessioncache.tiers.fileio import fsync_dir

logger = logging.getLogger(__name__)

BLOCK_SUFFIX = ".blk"


class BlockFolders:
    """``root/blocks/<hex[0:2]>/<hex[2:4]>/`` and ``root/quarantine/`` of one disk tier."""

    def __init__(self, root: str, who: str, *, fsync: bool, unlink: Callable[[str], None]) -> None:
        self.root = root
        self.blocks = os.path.join(root, "blocks")
        self.quarantine = os.path.join(root, "quarantine")
        self.ready: set[str] = set()
        """Folders known to exist durably (made and synced, or found by the walk)."""
        self._seen: set[str] = set()  # "abcd": blocks/ab/cd checked to be folders
        self._who = who
        self._fsync = fsync
        self._unlink = unlink

    def path(self, block_hash: bytes) -> str:
        hexid = block_hash.hex()
        return os.path.join(self.blocks, hexid[0:2], hexid[2:4], hexid + BLOCK_SUFFIX)

    def checked_path(self, block_hash: bytes) -> str:
        """``path``, its two folders checked to be folders (once per shard); where a link is
        planted in their place it is quarantined and the file is not found."""
        hexid = block_hash.hex()
        top = os.path.join(self.blocks, hexid[0:2])
        shard = os.path.join(top, hexid[2:4])
        if hexid[0:4] not in self._seen:
            for folder in (top, shard):
                if not stat.S_ISDIR(os.lstat(folder).st_mode):
                    self._quarantine_planted(folder)
                    raise FileNotFoundError(errno.ENOENT, "not a folder of the tier", folder)
            self._seen.add(hexid[0:4])
        return os.path.join(shard, hexid + BLOCK_SUFFIX)

    def shard_for_put(self, hexid: str) -> tuple[str, list[str]]:
        """The shard folder of ``hexid``, made where needed, and the folders made for it now
        (to be synced with the put's files, then marked ``ready``)."""
        top = os.path.join(self.blocks, hexid[0:2])
        shard = os.path.join(top, hexid[2:4])
        new_dirs: list[str] = []
        if shard not in self.ready:
            if self.blocks not in self.ready:
                self.make_base()  # a tier built without ``open``
            new_top = top not in self.ready
            if new_top:
                self._real_dir(top)
            self._real_dir(shard)
            new_dirs = [shard, top] if new_top else [shard]
            self._seen.add(hexid[0:4])
        return shard, new_dirs

    def make_base(self) -> None:
        """``root``, ``quarantine/`` and ``blocks/``, made where needed and durable."""
        for path in (self.root, self.quarantine, self.blocks):
            if path in self.ready:
                continue
            if path == self.root:
                os.makedirs(path, exist_ok=True)
            else:
                self._real_dir(path)
            if self._fsync:
                fsync_dir(path)
                fsync_dir(os.path.dirname(os.path.abspath(path)))
            self.ready.add(path)

    def shards(self) -> Iterator[tuple[str, list[str]]]:
        """Each folder under ``blocks/`` with its shard folders, in name order; a link in
        their place is quarantined, never walked."""
        with os.scandir(self.blocks) as top:
            tops = sorted(top, key=lambda e: e.name)
        for d1 in tops:
            if d1.is_symlink():
                self._quarantine_planted(d1.path)
                continue
            if not d1.is_dir(follow_symlinks=False):
                continue
            with os.scandir(d1.path) as mid:
                ordered = sorted(mid, key=lambda e: e.name)
            shards = []
            for d2 in ordered:
                if d2.is_symlink():
                    self._quarantine_planted(d2.path)
                elif d2.is_dir(follow_symlinks=False):
                    shards.append(d2.path)
                    self._seen.add(d1.name + d2.name)
            yield d1.path, shards

    def quarantine_name(self, block_hash: bytes) -> str:
        """Where a bad block file is moved."""
        return os.path.join(self.quarantine, f"{block_hash.hex()}.{time.time_ns()}{BLOCK_SUFFIX}")

    def _real_dir(self, path: str) -> None:
        """Make ``path`` a folder: one there is kept; anything else in its place is moved to
        quarantine, never followed, and a folder made instead."""
        for _ in range(2):
            try:
                if stat.S_ISDIR(os.lstat(path).st_mode):
                    return
                self._quarantine_planted(path)
            except FileNotFoundError:
                pass
            try:
                os.mkdir(path)
                return
            except FileExistsError:
                continue  # made meanwhile: checked again
        raise OSError(errno.ENOTDIR, "not a folder of the tier", path)

    def _quarantine_planted(self, path: str) -> None:
        """Move what is planted at ``path`` in place of a folder to quarantine (deleted where
        it cannot be moved: the tier's own folders)."""
        try:
            target = os.readlink(path)
        except OSError:
            target = "nothing: not a link"
        dest = os.path.join(self.quarantine, f"{os.path.basename(path)}.{time.time_ns()}.link")
        try:
            if os.path.dirname(path) == self.root:
                raise OSError(errno.EINVAL, "one of the tier's own folders")
            os.rename(path, dest)
        except OSError:
            self._unlink(path)
            dest = "nowhere (deleted)"
        logger.warning(
            "%s: %s is not a folder (a link to %s): never followed; moved to %s",
            self._who,
            path,
            target,
            dest,
        )
