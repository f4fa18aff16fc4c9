"""The disk tier's filesystem fills up (a size-limited tmpfs the test mounts; needs root): with
other files, durable stores answer 507 with a message that says so and written-behind stores
are held in memory or refused, never acknowledged and dropped; with the tier's own blocks, it
evicts by policy within what the filesystem holds. Once there is space, what was written
behind drains, and nothing acknowledged is lost."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from sessioncache.connector import StreamClient, discover
from sessioncache.connector.samehost import SameHostClient
from sessioncache.errors import DurableStoreFailed
from sessioncache.hashing import Namespace
from tests.support.servers import start_server

NS = {"model": "disk-full-model", "block_tokens": 4, "kv_dtype": "bf16", "kv_layout": "x"}
NS_STREAM = Namespace("disk-full-stream", block_tokens=4, kv_dtype="bf16", kv_layout="x")
BLOCK = 1 << 20


def payload(h: str) -> bytes:
    return bytes.fromhex(h) * (BLOCK // 16)


@contextlib.contextmanager
def tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """``folder`` (made here) as a tmpfs of ``size`` (skipped without root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    folder.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr!r}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """``<tmp>/data`` whose ``blocks/`` (the disk tier) is a 16 MiB tmpfs."""
    with tmpfs(tmp_path / "data" / "blocks", "16m") as blocks:
        yield blocks


def store(url: str, seed: int) -> tuple[list[str], list[httpx.Response]]:
    toks = [int(t) for t in np.random.default_rng(seed).integers(0, 9999, 4 * 2)]
    plan = httpx.post(f"{url}/v1/store", json={"namespace": NS, "tokens": toks}).json()
    replies = [
        httpx.put(f"{url}/v1/blocks/{h}", content=payload(h), timeout=30) for h in plan["missing"]
    ]
    return plan["missing"], replies


def metric(url: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
    assert m, name
    return float(m.group(1))


def disk_blocks(url: str) -> int:
    tiers = httpx.get(f"{url}/v1/stats").json()["tiers"]
    return int(next(t["blocks"] for t in tiers if t["name"] == "disk"))


def test_a_disk_full_of_other_files_refuses_what_it_cannot_hold_and_drains_after(
    small_fs: Path,
) -> None:
    """The disk tier's filesystem filled by another's file: nothing there the tier may evict.
    Durable stores are 507 `DurableStoreFailed` (REST and stream); written-behind stores are
    held in memory until it is full, then refused 507 `NoRoom` before any answer, never
    acknowledged and dropped. Once space returns, what was written behind drains to disk and
    stores succeed; after a restart every acknowledged block is there, byte-exact."""
    data = small_fs.parent
    with open(small_fs / "ballast", "wb") as f:  # 15.5 of the filesystem's 16 MiB
        f.write(b"\0" * (31 << 19))
    env = {"SESSIONCACHE_CPU_BYTES": str(8 << 20), "SESSIONCACHE_DISK_BYTES": str(256 << 20)}
    server = start_server(data, env)
    acked: list[str] = []
    try:
        url = server.url
        toks = [int(t) for t in np.random.default_rng(1).integers(0, 9999, 4 * 2)]
        plan = httpx.post(f"{url}/v1/store", json={"namespace": NS, "tokens": toks}).json()
        h = plan["missing"][0]
        r = httpx.put(f"{url}/v1/blocks/{h}?durable=true", content=payload(h), timeout=30)
        assert r.status_code == 507, r.text
        assert "full" in r.json()["detail"] and r.json()["error"] == "DurableStoreFailed"
        with StreamClient.connect(discover(url), timeout=30) as client:
            root = client.resolve(NS_STREAM)
            stream_toks = np.arange(8, dtype=np.uint32)
            ids = client.block_hashes(root, stream_toks)
            with pytest.raises(DurableStoreFailed, match="full"):
                client.store(
                    root, stream_toks, [np.full(BLOCK, 7, np.uint8) for _ in ids], durable=True
                )
        refused = None
        for seed in range(2, 20):
            ids, replies = store(url, seed)
            for h, r in zip(ids, replies, strict=True):
                assert r.status_code in (200, 507), r.text
                if r.status_code == 200:
                    assert r.json()["durable"] is False
                    acked.append(h)
                else:
                    refused = r
                    break
            if refused is not None:
                break
        assert refused is not None, "8 MiB of memory took 36 MiB"
        assert refused.json()["error"] == "NoRoom", refused.text
        assert len(acked) >= 4
        assert metric(url, "sessioncache_demotions_refused_total") > 0
        # the stream and the same host: the same refusal (answered dropped, none stored)
        where = httpx.get(f"{url}/v1/dataplane").json()["same_host"]
        for n, connect in enumerate(
            (
                lambda: StreamClient.connect(discover(url), timeout=30),
                lambda: SameHostClient.connect(where),
            )
        ):
            with connect() as client:
                root = client.resolve(NS_STREAM)
                toks = np.arange(100 + 8 * n, 108 + 8 * n, dtype=np.uint32)
                ids = client.block_hashes(root, toks)
                ack = client.store(root, toks, [np.full(BLOCK, 9, np.uint8) for _ in ids])
                assert ack.stored == 0 and ack.tally("dropped") == len(ids), ack
        for h in acked:  # every acknowledged block is held
            r = httpx.get(f"{url}/v1/blocks/{h}")
            assert r.status_code == 200 and r.content == payload(h), h
        # space returns: what was written behind drains to disk, and stores succeed again
        (small_fs / "ballast").unlink()
        deadline = time.monotonic() + 20
        while disk_blocks(url) < len(acked):
            assert time.monotonic() < deadline, "the written-behind blocks did not drain"
            time.sleep(0.2)
        ids, replies = store(url, 1000)
        assert [r.status_code for r in replies] == [200] * len(ids)
        acked += ids
    finally:
        server.stop()
    server = start_server(data, env)
    try:
        for h in acked:
            r = httpx.get(f"{server.url}/v1/blocks/{h}")
            assert r.status_code == 200 and r.content == payload(h), h
        assert not list(small_fs.rglob("*.tmp"))
    finally:
        server.stop()


@pytest.fixture
def small_data_dir(tmp_path: Path) -> Iterator[Path]:
    """``<tmp>/data``, the whole data dir (catalog too), a 64 MiB tmpfs."""
    with tmpfs(tmp_path / "data", "64m") as data:
        yield data


SMALL = 256 << 10
NS_BEHIND = {"model": "disk-full-behind", "block_tokens": 4, "kv_dtype": "bf16", "kv_layout": "x"}


def small_payload(h: str) -> bytes:
    return bytes.fromhex(h) * (SMALL // 16)


def test_a_filesystem_smaller_than_the_budget_loses_no_acknowledged_block(
    small_data_dir: Path,
) -> None:
    """28 MiB left on the data dir's filesystem, a 16 MiB CPU tier and a 1 GiB disk budget:
    40 MiB stored, durable and written-behind stores in turn, fit in memory and the room
    left together. Every 2xx is readable, byte-exact, and nothing is a 500: the disk tier
    sees its filesystem's room and evicts by policy (its spare copies first) instead of
    failing its writes, and a block it cannot take stays in memory."""
    data = small_data_dir
    with open(data / "ballast", "wb") as f:  # what else lives on that filesystem
        f.write(b"\0" * (36 << 20))
    server = start_server(
        data,
        {"SESSIONCACHE_CPU_BYTES": str(16 << 20), "SESSIONCACHE_DISK_BYTES": str(1 << 30)},
    )
    acked: list[str] = []
    codes: list[int] = []
    try:
        url = server.url
        rng = np.random.default_rng(7)
        with httpx.Client(base_url=url, timeout=60) as c:
            for chain in range(40):  # 40 chains of 4 blocks of 256 KiB
                toks = [int(t) for t in rng.integers(0, 50_000, 4 * 4)]
                plan = c.post("/v1/store", json={"namespace": NS_BEHIND, "tokens": toks})
                assert plan.status_code == 200, plan.text
                durable = "true" if chain % 2 else "false"
                for h in plan.json()["missing"]:
                    r = c.put(
                        f"/v1/blocks/{h}", params={"durable": durable}, content=small_payload(h)
                    )
                    codes.append(r.status_code)
                    if r.status_code == 200:
                        acked.append(h)
                    else:
                        assert r.status_code == 507, r.text
                        break
            time.sleep(2)  # the write-behind's turn
            lost = [h for h in acked if c.get(f"/v1/blocks/{h}").content != small_payload(h)]
            stats = c.get("/v1/stats").json()
            metrics = c.get("/metrics").text
    finally:
        server.stop()
    disk = next(t for t in stats["tiers"] if t["name"] == "disk")
    print(f"{len(acked)} of {len(codes)} acknowledged; disk tier: {disk}")
    assert 500 not in codes
    assert len(acked) == 160, codes  # it all fits
    assert not lost, f"{len(lost)} of {len(acked)} acknowledged blocks lost"
    assert disk["room_bytes"] < 32 << 20 < disk["capacity_bytes"]
    assert "sessioncache_write_behind_failed_total 0.0" in metrics
