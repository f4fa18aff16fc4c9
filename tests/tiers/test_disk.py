"""DiskTier: round trips, persistence, corruption handling, capacity, threads and kill -9."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

import sessioncache.tiers.disk as disk_mod
import sessioncache.tiers.fileio as fileio
from sessioncache.errors import InvalidInput, PayloadSizeError, TierFull, TierUnavailable
from sessioncache.hashing import BlockHash
from sessioncache.tiers.base import PutItem, RecoverableTier, RecoveredBatch, RecoveredBlock, Tier
from sessioncache.tiers.disk import HEADER_SIZE, DiskTier, decode_header

NS = b"N" * 16
NS2 = b"M" * 16
MIB = 1 << 20


def bid(i: int | str) -> BlockHash:
    return BlockHash(xxhash.xxh3_128_digest(f"block-{i}".encode()))


def payload_for(h: bytes, size: int | None = None) -> bytes:
    """A deterministic payload derived from the id (size 1..64 KiB unless given)."""
    seed = int.from_bytes(h[:8], "little")
    n = size if size is not None else 1 + seed % (64 << 10)
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def root_on_disk(root: Path, h: bytes) -> bytes:
    """The namespace root recorded in the block file's header."""
    return decode_header(block_file(root, h).read_bytes()[:HEADER_SIZE])[1]


def block_file(root: Path, h: bytes) -> Path:
    x = h.hex()
    return root / "blocks" / x[0:2] / x[2:4] / f"{x}.blk"


def quarantined(root: Path) -> list[Path]:
    return sorted((root / "quarantine").iterdir())


def all_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "blocks").rglob("*") if p.is_file())


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "disk"


@pytest.fixture
def tier(root: Path) -> DiskTier:
    return DiskTier.open(root, 16 * MIB)


# ---------------------------------------------------------------------------------- basics


def test_protocols(tier: DiskTier) -> None:
    assert isinstance(tier, Tier)
    assert isinstance(tier, RecoverableTier)
    assert tier.name == "disk" and tier.durable and tier.capacity_bytes == 16 * MIB
    assert DiskTier.open(tier.root, 1, name="ssd").name == "ssd"


def test_round_trip_payload_kinds(tier: DiskTier, root: Path) -> None:
    raw = payload_for(bid(1), 5000)
    kinds: list[object] = [
        raw,
        bytearray(raw),
        memoryview(raw),
        np.frombuffer(raw, dtype=np.uint8),
        torch.frombuffer(bytearray(raw), dtype=torch.uint8),
        torch.frombuffer(bytearray(raw), dtype=torch.float16),  # 2500 halves, same bytes
    ]
    for i, p in enumerate(kinds):
        h = bid(f"kind{i}")
        tier.put(PutItem(h, p, NS))  # type: ignore[arg-type]
        out = tier.get(h)
        assert out is not None
        assert out.dtype == torch.uint8 and out.dim() == 1
        assert out.numpy().tobytes() == raw
        assert tier.contains(h) and root_on_disk(root, h) == NS
        assert block_file(root, h).stat().st_size == HEADER_SIZE + len(raw)
    assert tier.used_bytes == len(kinds) * len(raw)
    assert sorted(tier.keys()) == sorted(bid(f"kind{i}") for i in range(len(kinds)))
    assert not any(p.name.endswith(".tmp") for p in all_files(root))


def test_multi_chunk_payload_round_trip(tier: DiskTier) -> None:
    # Larger than the write-back chunk and not a multiple of it.
    data = payload_for(bid("big"), 3 * MIB + 12345)
    tier.put(PutItem(bid("big"), data, NS))
    out = tier.get(bid("big"))
    assert out is not None and out.numpy().tobytes() == data


def test_miss_duplicate_and_delete(tier: DiskTier, root: Path) -> None:
    h = bid(1)
    assert tier.get(h) is None and not tier.contains(h) and tier.delete(h) == 0
    tier.put(PutItem(h, b"abc", NS))
    tier.put(PutItem(h, b"different and longer", NS2))  # already held: no-op
    assert tier.used_bytes == 3
    out = tier.get(h)
    assert out is not None and out.numpy().tobytes() == b"abc"
    assert root_on_disk(root, h) == NS
    assert tier.delete(h) == 3
    assert tier.used_bytes == 0 and not tier.contains(h) and tier.get(h) is None
    assert not block_file(root, h).exists()
    tier.put(PutItem(h, b"again", NS))  # re-put after delete
    out = tier.get(h)
    assert out is not None and out.numpy().tobytes() == b"again"


def test_invalid_input(tier: DiskTier) -> None:
    with pytest.raises(InvalidInput):
        tier.put(PutItem(BlockHash(b"short"), b"x", NS))
    with pytest.raises(InvalidInput):
        tier.put(PutItem(bid(1), b"x", b"short-ns"))
    with pytest.raises(PayloadSizeError):
        tier.put(PutItem(bid(1), b"", NS))
    with pytest.raises(InvalidInput):
        DiskTier(tier.root, -1)
    assert tier.used_bytes == 0 and tier.keys() == []


def test_init_is_cheap_and_lazy(root: Path) -> None:
    t = DiskTier(root, MIB, fsync=False)
    assert not root.exists()
    t.put(PutItem(bid(1), b"hello", NS))
    assert block_file(root, bid(1)).exists() and (root / "quarantine").is_dir()
    out = t.get(bid(1))
    assert out is not None and out.numpy().tobytes() == b"hello"


# ------------------------------------------------------------------------------ persistence


def test_persistence_across_reopen(root: Path) -> None:
    t1 = DiskTier.open(root, 16 * MIB)
    ids = [bid(i) for i in range(20)]
    for i, h in enumerate(ids):
        t1.put(PutItem(h, payload_for(h), NS if i % 2 else NS2))
    t1.delete(ids[0])
    used = t1.used_bytes
    t1.close()

    t2 = DiskTier.open(root, 16 * MIB)
    assert t2.used_bytes == used
    assert sorted(t2.keys()) == sorted(ids[1:])
    rec = {r.block_hash: r for r in t2.recovered()}
    assert set(rec) == set(ids[1:])
    for i, h in enumerate(ids[1:], start=1):
        r = rec[h]
        assert isinstance(r, RecoveredBlock)
        assert r.nbytes == len(payload_for(h))
        assert r.namespace_root == (NS if i % 2 else NS2)
        assert abs(r.mtime - block_file(root, h).stat().st_mtime) < 1e-6
        out = t2.get(h)
        assert out is not None and out.numpy().tobytes() == payload_for(h)
    t2.delete(ids[1])
    assert ids[1] not in {r.block_hash for r in t2.recovered()}


def test_recovered_over_capacity_keeps_everything(root: Path) -> None:
    t1 = DiskTier.open(root, MIB)
    for i in range(10):
        t1.put(PutItem(bid(i), payload_for(bid(i), 1000), NS))
    t2 = DiskTier.open(root, 4000)
    assert t2.used_bytes == 10_000 and len(t2.keys()) == 10
    assert not t2.fits(1)
    with pytest.raises(TierFull):
        t2.put(PutItem(bid("new"), b"x", NS))
    for i in range(7):
        t2.delete(bid(i))
    assert t2.used_bytes == 3000 and t2.fits(1000) and not t2.fits(1001)


def test_stale_temp_files_removed_on_open(root: Path) -> None:
    t = DiskTier.open(root, MIB)
    t.put(PutItem(bid(1), b"keep", NS))
    shard = block_file(root, bid(1)).parent
    stale = shard / f".{bid(1).hex()}.deadbeef.tmp"
    stale.write_bytes(b"half a block")
    other = root / "blocks" / "ff" / "ee"
    other.mkdir(parents=True)
    (other / f".{'ff' * 16}.0.tmp").write_bytes(b"x")
    DiskTier.open(root, MIB)
    assert not stale.exists() and not list(other.iterdir())
    assert block_file(root, bid(1)).exists()


def test_unrelated_files_left_alone(root: Path) -> None:
    DiskTier.open(root, MIB).put(PutItem(bid(1), b"x", NS))
    shard = block_file(root, bid(1)).parent
    (shard / "README").write_text("mine")
    (shard / "not-hex.blk").write_text("mine")
    t = DiskTier.open(root, MIB)
    assert t.keys() == [bid(1)]
    assert (shard / "README").exists() and (shard / "not-hex.blk").exists()
    assert quarantined(root) == []


# ------------------------------------------------------------------------------- corruption


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_payload_bitflip_is_quarantined_on_get(
    tier: DiskTier, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    h, keep = bid(1), bid(2)
    tier.put(PutItem(h, payload_for(h, 4096), NS))
    tier.put(PutItem(keep, payload_for(keep, 100), NS))
    _flip(block_file(root, h), HEADER_SIZE + 1000)
    with caplog.at_level(logging.WARNING, logger="sessioncache.tiers.disk"):
        assert tier.get(h) is None
    assert "checksum" in caplog.text
    assert not tier.contains(h) and tier.used_bytes == 100
    assert not block_file(root, h).exists()
    q = quarantined(root)
    assert len(q) == 1 and q[0].name.startswith(h.hex())
    assert tier.get(h) is None  # a plain miss now
    out = tier.get(keep)
    assert out is not None and out.numpy().tobytes() == payload_for(keep, 100)
    # Re-storing a quarantined block works.
    tier.put(PutItem(h, payload_for(h, 4096), NS))
    out = tier.get(h)
    assert out is not None and out.numpy().tobytes() == payload_for(h, 4096)


def test_header_corruption_while_running(tier: DiskTier, root: Path) -> None:
    for i, offset in enumerate([0, 9, 20, 40, 50, 60, 66]):
        h = bid(f"hdr{i}")
        tier.put(PutItem(h, b"payload", NS))
        _flip(block_file(root, h), offset)
        assert tier.get(h) is None, offset
        assert not tier.contains(h)
    assert tier.used_bytes == 0 and len(quarantined(root)) == 7


@pytest.mark.parametrize(
    "damage",
    ["truncate_payload", "truncate_header", "empty", "extend", "torn_header", "wrong_id"],
)
def test_bad_files_quarantined_on_open(root: Path, damage: str) -> None:
    t = DiskTier.open(root, MIB)
    h, keep = bid(1), bid(2)
    t.put(PutItem(h, payload_for(h, 5000), NS))
    t.put(PutItem(keep, payload_for(keep, 700), NS))
    path = block_file(root, h)
    if damage == "truncate_payload":
        os.truncate(path, HEADER_SIZE + 4999)
    elif damage == "truncate_header":
        os.truncate(path, HEADER_SIZE - 10)
    elif damage == "empty":
        os.truncate(path, 0)
    elif damage == "extend":
        with open(path, "ab") as f:
            f.write(b"junk")
    elif damage == "torn_header":
        with open(path, "r+b") as f:
            f.seek(30)
            f.write(b"\x00" * 30)
    elif damage == "wrong_id":  # a valid file under another block's name
        other = block_file(root, bid(3))
        other.parent.mkdir(parents=True, exist_ok=True)
        os.rename(path, other)
        h, path = bid(3), other
    t2 = DiskTier.open(root, MIB)
    assert t2.keys() == [keep] and t2.used_bytes == 700
    assert not path.exists()
    assert [p.name.split(".")[0] for p in quarantined(root)] == [h.hex()]
    assert t2.get(h) is None


def test_truncation_after_open_is_quarantined_on_get(tier: DiskTier, root: Path) -> None:
    h = bid(1)
    tier.put(PutItem(h, payload_for(h, 3000), NS))
    os.truncate(block_file(root, h), HEADER_SIZE + 10)
    assert tier.get(h) is None
    assert not tier.contains(h) and tier.used_bytes == 0 and len(quarantined(root)) == 1


def test_file_vanished_is_a_miss(tier: DiskTier, root: Path) -> None:
    h = bid(1)
    tier.put(PutItem(h, b"gone soon", NS))
    os.unlink(block_file(root, h))
    assert tier.get(h) is None
    assert not tier.contains(h) and tier.used_bytes == 0 and quarantined(root) == []
    assert tier.delete(h) == 0


# --------------------------------------------------------------------------------- capacity


def test_capacity(root: Path) -> None:
    t = DiskTier.open(root, 10_000)
    with pytest.raises(PayloadSizeError):
        t.put(PutItem(bid(0), b"x" * 10_001, NS))
    t.put(PutItem(bid(1), b"a" * 6000, NS))
    assert t.fits(4000) and not t.fits(4001) and not t.fits(0)
    with pytest.raises(TierFull):
        t.put(PutItem(bid(2), b"b" * 4001, NS))
    assert t.used_bytes == 6000 and not t.contains(bid(2))
    assert all_files(root) == [block_file(root, bid(1))]  # nothing half-written
    t.put(PutItem(bid(3), b"c" * 4000, NS))  # exactly full
    assert t.used_bytes == 10_000 and not t.fits(1)
    t.delete(bid(1))
    t.put(PutItem(bid(2), b"b" * 4001, NS))
    assert t.used_bytes == 8001


def test_failed_write_releases_reservation(
    tier: DiskTier, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(fd: int, buffers: list[memoryview]) -> None:
        os.write(fd, b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    for module in (disk_mod, fileio):  # the plain write, and the chunked write-back's
        monkeypatch.setattr(module, "write_all", no_space)
    with pytest.raises(TierFull):
        tier.put(PutItem(bid(1), b"x" * 5000, NS))
    assert tier.used_bytes == 0 and tier.fits(16 * MIB) and not tier.contains(bid(1))
    assert all_files(root) == []  # the temp file is gone

    def io_error(fd: int, buffers: list[memoryview]) -> None:
        raise OSError(errno.EIO, "I/O error")

    for module in (disk_mod, fileio):
        monkeypatch.setattr(module, "write_all", io_error)
    with pytest.raises(TierUnavailable):  # an I/O error is no crash: the tier cannot write
        tier.put(PutItem(bid(1), b"x" * 5000, NS))
    assert tier.fits(16 * MIB) and all_files(root) == []
    monkeypatch.undo()
    tier.put(PutItem(bid(1), b"x" * 5000, NS))
    assert tier.used_bytes == 5000


# ---------------------------------------------------------------------------------- threads


def _run_threads(n: int, fn: Callable[[int], None]) -> list[BaseException]:
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def body(k: int) -> None:
        barrier.wait()
        try:
            fn(k)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(k,)) for k in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return errors


def test_concurrent_distinct_puts(tier: DiskTier, root: Path) -> None:
    ids = [[bid(f"t{k}-{i}") for i in range(12)] for k in range(8)]

    def body(k: int) -> None:
        for h in ids[k]:
            tier.put(PutItem(h, payload_for(h), NS))

    assert _run_threads(8, body) == []
    flat = [h for row in ids for h in row]
    assert tier.used_bytes == sum(len(payload_for(h)) for h in flat)
    assert sorted(tier.keys()) == sorted(flat)
    assert len(all_files(root)) == len(flat)
    reopened = DiskTier.open(root, 16 * MIB)
    assert reopened.used_bytes == tier.used_bytes
    for h in flat:
        out = reopened.get(h)
        assert out is not None and out.numpy().tobytes() == payload_for(h)


def test_concurrent_same_id_puts(tier: DiskTier, root: Path) -> None:
    ids = [bid(f"same{i}") for i in range(10)]
    seen: list[bool] = []

    def body(k: int) -> None:
        for h in ids:
            tier.put(PutItem(h, payload_for(h), NS))
            seen.append(tier.contains(h))  # held as soon as any put of it returns

    assert _run_threads(8, body) == []
    assert all(seen)
    assert tier.used_bytes == sum(len(payload_for(h)) for h in ids)
    assert all_files(root) == sorted(block_file(root, h) for h in ids)
    for h in ids:
        out = tier.get(h)
        assert out is not None and out.numpy().tobytes() == payload_for(h)


def test_concurrent_puts_never_overshoot_capacity(root: Path) -> None:
    t = DiskTier.open(root, 10 * 4096)
    full: list[int] = []

    def body(k: int) -> None:
        for i in range(4):
            try:
                t.put(PutItem(bid(f"cap{k}-{i}"), b"z" * 4096, NS))
            except TierFull:
                full.append(k)

    assert _run_threads(8, body) == []
    assert len(t.keys()) == 10 and len(full) == 22
    assert t.used_bytes == 10 * 4096 == t.capacity_bytes
    assert len(all_files(root)) == 10


def test_concurrent_put_get_delete(tier: DiskTier) -> None:
    ids = [bid(f"mix{i}") for i in range(16)]
    bad: list[str] = []

    def body(k: int) -> None:
        for r in range(6):
            for h in ids[k % 4 :: 4]:
                if (k + r) % 3 == 0:
                    tier.delete(h)
                else:
                    tier.put(PutItem(h, payload_for(h), NS))
                out = tier.get(h)
                if out is not None and out.numpy().tobytes() != payload_for(h):
                    bad.append(h.hex())

    assert _run_threads(8, body) == []
    assert bad == []
    held = tier.keys()
    assert tier.used_bytes == sum(len(payload_for(h)) for h in held)
    assert tier.fits(tier.capacity_bytes - tier.used_bytes)


# ---------------------------------------------------------------------------------- kill -9

_WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import xxhash
    from sessioncache.tiers.base import PutItem
    from sessioncache.tiers.disk import DiskTier

    tier = DiskTier.open(sys.argv[1], 1 << 40)
    i = 0
    while True:
        h = xxhash.xxh3_128_digest(f"block-kill{i}".encode())
        seed = int.from_bytes(h[:8], "little")
        n = 1 + seed % (256 << 10)
        payload = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
        tier.put(PutItem(h, payload, b"N" * 16))
        sys.stdout.write(h.hex() + "\\n")
        sys.stdout.flush()
        i += 1
    """
)


def test_kill_9_keeps_every_acknowledged_put(root: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    acked: list[str] = []
    try:
        assert proc.stdout is not None
        while len(acked) < 60:
            line = proc.stdout.readline()
            if not line:
                pytest.fail(f"writer died: {proc.stderr.read() if proc.stderr else ''}")
            acked.append(line.strip())
        os.kill(proc.pid, signal.SIGKILL)
        rest = proc.stdout.read()  # with what its readline read ahead (``communicate`` skips it)
        proc.wait(timeout=30)
        acked += [x.strip() for x in rest.splitlines() if x.strip()]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL

    tier = DiskTier.open(root, 1 << 40)
    held = set(tier.keys())
    for x in acked:
        h = BlockHash(bytes.fromhex(x))
        assert h in held, x
        out = tier.get(h)
        seed = int.from_bytes(h[:8], "little")
        expected = payload_for(h, 1 + seed % (256 << 10))
        assert out is not None and out.numpy().tobytes() == expected, x
    # At most the one put in flight at the kill may be held beyond the acknowledged ones.
    assert len(held - {bytes.fromhex(x) for x in acked}) <= 1
    assert not any(p.name.endswith(".tmp") for p in all_files(root))
    assert tier.used_bytes == sum(r.nbytes for r in tier.recovered())


# ------------------------------------------------------------------ adopted on trust (restart)


def test_adopt_batch_indexes_unopened_files_and_checks_each_on_get(root: Path) -> None:
    ids = [bid(f"adopt-{i}") for i in range(6)]
    writer = DiskTier.open(root, 16 * MIB)
    for h in ids[:5]:
        writer.put(PutItem(h, payload_for(h, 4096), NS))
    writer.close()
    tier = DiskTier.open(root, 16 * MIB, scan=False)
    tier.put(PutItem(ids[0], payload_for(ids[0], 4096), NS))  # already held: left as it is
    block_file(root, ids[1]).write_bytes(b"garbage")  # a bad file, found by its read
    batch = RecoveredBatch.of(
        [RecoveredBlock(h, NS, 4096, 1.0, None, ttl_s=60.0, expires_at=61.0) for h in ids]
    )
    tier.adopt_batch(batch)  # ids[5] has a row but no file
    assert tier.used_bytes == 6 * 4096
    assert sorted(tier.keys()) == sorted(ids)
    assert tier.get(ids[2]) is not None
    assert bytes(tier.get(ids[3]).numpy()) == payload_for(ids[3], 4096)
    assert tier.get(ids[1]) is None  # quarantined, and only it dropped
    assert len(quarantined(root)) == 1
    assert tier.get(ids[5]) is None
    assert sorted(tier.keys()) == sorted([ids[0], ids[2], ids[3], ids[4]])
    assert tier.used_bytes == 4 * 4096
    # a delete and a re-put of an adopted id: a fresh entry, read back as written
    assert tier.delete(ids[4]) == 4096
    tier.put(PutItem(ids[4], payload_for(ids[4], 4096), NS))
    assert bytes(tier.get(ids[4]).numpy()) == payload_for(ids[4], 4096)


def test_adopted_blocks_without_files_are_missing_after_the_walk(root: Path) -> None:
    ids = [bid(f"walk-{i}") for i in range(4)]
    writer = DiskTier.open(root, 16 * MIB)
    for h in ids[:2]:
        writer.put(PutItem(h, payload_for(h, 512), NS))
    writer.put(PutItem(ids[3], payload_for(ids[3], 512), NS2))  # a file without a row
    tier = DiskTier.open(root, 16 * MIB, scan=False)
    tier.adopt_batch(RecoveredBatch.of([RecoveredBlock(h, NS, 512, 1.0) for h in ids[:3]]))
    tier.adopt([RecoveredBlock(ids[0], NS, 512, 1.0)])  # known: no double count
    assert tier.used_bytes == 3 * 512
    found = tier.scan_unindexed()
    assert [b.block_hash for b in found] == [ids[3]] and found[0].namespace_root == NS2
    assert tier.missing() == [ids[2]]
    assert sorted(tier.keys()) == sorted([ids[0], ids[1], ids[3]])
    assert tier.used_bytes == 3 * 512
