"""The disk tier's filesystem fills up (a size-limited tmpfs the test mounts; needs root):
durable stores answer 507 with a message that says so, reads keep working, nothing already
stored is damaged, and stores succeed again once there is space."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from sessioncache.connector import StreamClient, discover
from sessioncache.errors import DurableStoreFailed
from sessioncache.hashing import Namespace
from tests.support.servers import DURABLE_NODE, start_server

NS = {"model": "disk-full-model", "block_tokens": 4, "kv_dtype": "bf16", "kv_layout": "x"}
NS_STREAM = Namespace("disk-full-stream", block_tokens=4, kv_dtype="bf16", kv_layout="x")
BLOCK = 1 << 20


def payload(h: str) -> bytes:
    return bytes.fromhex(h) * (BLOCK // 16)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """``<tmp>/data`` whose ``blocks/`` (the disk tier) is an 8 MiB tmpfs."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    blocks = tmp_path / "data" / "blocks"
    blocks.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(blocks)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr!r}")
    try:
        yield blocks
    finally:
        subprocess.run(["umount", "-l", str(blocks)], check=False)


def store(url: str, seed: int) -> tuple[list[str], list[httpx.Response]]:
    toks = [int(t) for t in np.random.default_rng(seed).integers(0, 9999, 4 * 2)]
    plan = httpx.post(f"{url}/v1/store", json={"namespace": NS, "tokens": toks}).json()
    replies = [
        httpx.put(f"{url}/v1/blocks/{h}", content=payload(h), timeout=30) for h in plan["missing"]
    ]
    return plan["missing"], replies


def test_disk_full_answers_507_and_recovers(small_fs: Path) -> None:
    data = small_fs.parent
    server = start_server(
        data,
        {
            **DURABLE_NODE,
            "SESSIONCACHE_CPU_BYTES": str(64 << 20),
            "SESSIONCACHE_DISK_BYTES": str(256 << 20),
        },
    )
    acked: list[str] = []
    try:
        url = server.url
        full = None
        for seed in range(20):
            ids, replies = store(url, seed)
            for h, r in zip(ids, replies, strict=True):
                if r.status_code == 200:
                    assert r.json()["durable"]
                    acked.append(h)
                else:
                    full = r
                    break
            if full is not None:
                break
        assert full is not None, "an 8 MiB filesystem took 40 MiB"
        assert full.status_code == 507, full.text
        assert "full" in full.json()["detail"] and full.json()["error"] == "DurableStoreFailed"
        assert len(acked) >= 4
        # reads keep working, byte-exact
        for h in acked:
            r = httpx.get(f"{url}/v1/blocks/{h}")
            assert r.status_code == 200 and r.content == payload(h)
        assert httpx.get(f"{url}/healthz").status_code == 200
        # the stream: the same refusal, as its own error code, and the connection goes on
        with StreamClient.connect(discover(url), timeout=30) as client:
            root = client.resolve(NS_STREAM)
            toks = np.arange(8, dtype=np.uint32)
            ids = client.block_hashes(root, toks)
            with pytest.raises(DurableStoreFailed, match="full"):
                client.store(root, toks, [np.full(BLOCK, 7, np.uint8) for _ in ids])
            assert client.lookup(root, ids).matched <= len(ids)
        # space returns: stores succeed again
        subprocess.run(["mount", "-o", "remount,size=128m", str(small_fs)], check=True)
        ids, replies = store(url, 1000)
        assert [r.status_code for r in replies] == [200] * len(ids)
        acked += ids
    finally:
        server.stop()
    # nothing acknowledged was damaged: all there after a restart, byte-exact
    server = start_server(data, DURABLE_NODE)
    try:
        for h in acked:
            r = httpx.get(f"{server.url}/v1/blocks/{h}")
            assert r.status_code == 200 and r.content == payload(h), h
        assert not list(small_fs.rglob("*.tmp"))
    finally:
        server.stop()
