"""The data dir is a closed world: a symbolic link planted in place of a disk-tier folder (or
of a block file) is never written through nor read through. On a real node: a shard folder
replaced by a link to a folder outside that holds a valid copy of its blocks, then a restart,
reads of the blocks it held and new blocks whose ids fall in it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import numpy as np

from sessioncache.hashing import Namespace, block_hashes
from sessioncache.tiers.base import PutItem
from sessioncache.tiers.disk import DiskTier
from tests.support.servers import DURABLE_NODE, start_server

NS = {"model": "links-model", "block_tokens": 4, "kv_dtype": "bf16", "kv_layout": "x"}
BLOCK = 4096


def payload(bid: bytes) -> bytes:
    return bid * (BLOCK // 16)


def store(url: str, toks: list[int]) -> list[str]:
    plan = httpx.post(f"{url}/v1/store", json={"namespace": NS, "tokens": toks}, timeout=10)
    assert plan.status_code == 200, plan.text
    for h in plan.json()["missing"]:
        r = httpx.put(f"{url}/v1/blocks/{h}", content=payload(bytes.fromhex(h)), timeout=10)
        assert r.status_code == 200 and r.json()["durable"], r.text
    hashes: list[str] = plan.json()["hashes"]
    return hashes


def one_block_prompts_under(prefix: str, n: int, seed: int) -> list[list[int]]:
    """``n`` one-block prompts whose block ids start with the hex ``prefix``."""
    rng = np.random.default_rng(seed)
    found: list[list[int]] = []
    namespace = Namespace(**NS)  # type: ignore[arg-type]
    while len(found) < n:
        toks = [int(t) for t in rng.integers(0, 50_000, 4)]
        if block_hashes(namespace, toks)[0].hex().startswith(prefix):
            found.append(toks)
    return found


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_linked_shard_folder_is_neither_read_nor_written_through(tmp_path: Path) -> None:
    data = tmp_path / "data"
    outside = tmp_path / "outside"
    toks = [int(t) for t in np.random.default_rng(5).integers(0, 9999, 4 * 6)]
    server = start_server(data, DURABLE_NODE)
    try:
        ids = store(server.url, toks)
    finally:
        server.stop()
    top = ids[0][:2]
    real = data / "blocks" / "blocks" / top
    shutil.copytree(real, outside)  # a valid copy of the folder's blocks, outside
    shutil.rmtree(real)
    real.symlink_to(outside, target_is_directory=True)
    before = files_under(outside)
    server = start_server(data, DURABLE_NODE)
    try:
        url = server.url
        r = httpx.get(f"{url}/v1/blocks/{ids[0]}")
        assert r.status_code == 404, r.status_code  # not served through the link
        for h in ids[1:]:
            if not h.startswith(top):
                assert httpx.get(f"{url}/v1/blocks/{h}").content == payload(bytes.fromhex(h))
        new = [store(url, p)[0] for p in one_block_prompts_under(top, 5, seed=6)]
        for h in new:
            assert httpx.get(f"{url}/v1/blocks/{h}").content == payload(bytes.fromhex(h))
    finally:
        server.stop()
    assert files_under(outside) == before  # nothing written, moved or removed out there
    assert not real.is_symlink() and real.is_dir()
    for h in new:
        assert (real / h[2:4] / f"{h}.blk").is_file()
    planted = [p for p in (data / "blocks" / "quarantine").iterdir() if p.name.endswith(".link")]
    assert len(planted) == 1 and planted[0].is_symlink(), planted
    # and after another restart the new blocks are there, the planted one still not
    server = start_server(data, DURABLE_NODE)
    try:
        for h in new:
            assert httpx.get(f"{server.url}/v1/blocks/{h}").content == payload(bytes.fromhex(h))
        assert httpx.get(f"{server.url}/v1/blocks/{ids[0]}").status_code == 404
    finally:
        server.stop()


def test_links_in_place_of_block_files_and_folders_are_quarantined_by_the_walk(
    tmp_path: Path,
) -> None:
    """The tier itself, on its start-up walk: a linked block file is a damaged one, a linked
    top folder is never walked; what they point to is left untouched."""
    namespace = Namespace(**NS)  # type: ignore[arg-type]
    root = namespace.root()
    ids = block_hashes(namespace, list(range(4 * 40)))
    tier = DiskTier.open(tmp_path / "tier", 1 << 30, fsync=False)
    for h in ids:
        tier.put(PutItem(h, payload(h), root))
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = Path(tier.folders.path(ids[0]))
    os.rename(victim, outside / victim.name)
    victim.symlink_to(outside / victim.name)  # a valid block file, behind a link
    other = next(h for h in ids if h.hex()[:2] != ids[0].hex()[:2])
    top = Path(tier.folders.path(other)).parent.parent
    held = {h for h in ids if h.hex()[:2] == other.hex()[:2]}
    shutil.move(top, outside / "top")
    top.symlink_to(outside / "top", target_is_directory=True)
    before = files_under(outside)
    reopened = DiskTier.open(tmp_path / "tier", 1 << 30, fsync=False)
    assert not reopened.contains(ids[0]) and reopened.get(ids[0]) is None
    assert not any(reopened.contains(h) for h in held)
    assert all(reopened.contains(h) for h in ids if h != ids[0] and h not in held)
    assert files_under(outside) == before
    quarantined = sorted(p.name for p in (tmp_path / "tier" / "quarantine").iterdir())
    assert len(quarantined) == 2, quarantined
    assert not victim.exists() and not top.is_symlink()


def test_a_file_in_place_of_a_folder_is_a_miss_on_a_read(tmp_path: Path) -> None:
    """A fast restart trusts the catalog's rows (no walk yet): the read of a block whose top
    folder was replaced by a plain file is a miss, the file quarantined, not an error."""
    namespace = Namespace(**NS)  # type: ignore[arg-type]
    ids = block_hashes(namespace, list(range(4 * 8)))
    tier = DiskTier.open(tmp_path / "tier", 1 << 30, fsync=False)
    for h in ids:
        tier.put(PutItem(h, payload(h), namespace.root()))
    known = list(DiskTier.open(tmp_path / "tier", 1 << 30, fsync=False).recovered())
    top = Path(tier.folders.path(ids[0])).parent.parent
    shutil.rmtree(top)
    top.write_bytes(b"planted")
    restarted = DiskTier.open(tmp_path / "tier", 1 << 30, fsync=False, scan=False)
    restarted.adopt(known)
    assert restarted.get(ids[0]) is None
    assert not top.exists()
    (planted,) = (tmp_path / "tier" / "quarantine").iterdir()
    assert planted.name.endswith(".link")
    other = next(h for h in ids if h.hex()[:2] != ids[0].hex()[:2])
    got = restarted.get(other)
    assert got is not None and bytes(got.numpy()) == payload(other)
