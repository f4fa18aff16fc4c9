"""A durable store that could not reach the disk says so, and its retry makes the block
durable or says so again: never ``durable`` for a block in memory only. The fault is real:
the process runs out of file descriptors while it writes. (In-process, on the store itself:
tests/security/test_connections.py runs the same fault through a node with two tenants.)"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sessioncache.errors import DurableStoreFailed
from sessioncache.store import TieredStore
from sessioncache.tiers.cpu import CpuTier
from sessioncache.tiers.disk import DiskTier

ROOT = b"\x05" * 16
SIZE = 4096


@contextmanager
def out_of_descriptors() -> Iterator[None]:
    """Every descriptor the process may open is open until the block ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
    try:
        while True:
            try:
                held.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                break
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_durable_put_out_of_descriptors_fails_and_its_retry_is_durable(
    tmp_path: Path,
) -> None:
    disk = DiskTier.open(tmp_path / "disk", 64 * SIZE)
    store = TieredStore([CpuTier(64 * SIZE), disk])
    h = [bytes([i]) * 16 for i in range(1, 3)]
    payloads = [bytes([i]) * SIZE for i in range(2)]
    with out_of_descriptors(), pytest.raises(DurableStoreFailed):
        store.writes.put(h[:1], payloads[:1], namespace_root=ROOT, durable=True)
    assert not disk.contains(h[0])  # held in memory only, and not answered durable
    with out_of_descriptors(), pytest.raises(DurableStoreFailed):
        store.writes.put(h[:1], payloads[:1], namespace_root=ROOT, durable=True)
    result = store.writes.put(h, payloads, namespace_root=ROOT, durable=True)
    assert [s.held for s in result.status] == [True, True]
    assert disk.contains(h[0]) and disk.contains(h[1])  # the retry made the first durable
