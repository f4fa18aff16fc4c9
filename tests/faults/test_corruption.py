"""Disk-tier files damaged while the node is down (flipped bytes, truncation): on every read
path (REST by id, REST batch, stream) the damaged block is detected, counted in ``/metrics``,
moved to ``quarantine/`` and never served; the intact ones are served byte-exact. (The tier
itself is covered in tests/tiers/; the shared Redis tier's damaged values, through a node, in
tests/faults/test_redis_corruption.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import numpy as np

from sessioncache.connector import StreamClient, discover
from sessioncache.dataplane.frames.batch import decode_batch
from tests.support.servers import DURABLE_NODE, start_server

NS = {"model": "corrupt-model", "block_tokens": 4, "kv_dtype": "bf16", "kv_layout": "x"}
BLOCK = 4096


def payload(bid: bytes) -> bytes:
    return bid * (BLOCK // 16)


def block_file(data: Path, hexid: str) -> Path:
    found = [p for p in (data / "blocks").rglob(f"{hexid}*") if not p.name.endswith(".tmp")]
    assert len(found) == 1, found
    return found[0]


def corrupt_reads(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    m = re.search(r"^sessioncache_corrupt_reads(?:_total)? (\S+)$", text, re.M)
    assert m, text
    return float(m.group(1))


def test_damaged_files_are_never_served(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = start_server(data, DURABLE_NODE)
    toks = [int(t) for t in np.random.default_rng(3).integers(0, 9999, 4 * 9)]
    try:
        plan = httpx.post(
            f"{server.url}/v1/store", json={"namespace": NS, "tokens": toks}, timeout=10
        ).json()
        for h in plan["missing"]:
            r = httpx.put(f"{server.url}/v1/blocks/{h}", content=payload(bytes.fromhex(h)))
            assert r.status_code == 200 and r.json()["durable"]
    finally:
        server.stop()
    ids = plan["hashes"]
    # three damaged blocks per read path: a flipped payload byte, a flipped header byte, a cut
    damaged = {ids[1], ids[2], ids[4], ids[5], ids[7], ids[8]}
    for n, h in enumerate(sorted(damaged)):
        path = block_file(data, h)
        raw = bytearray(path.read_bytes())
        if n % 3 == 2:
            raw = raw[: len(raw) - 100]
        else:
            at = len(raw) - 10 if n % 3 == 0 else 3
            raw[at] ^= 0x55
        path.write_bytes(bytes(raw))
    server = start_server(data, DURABLE_NODE)
    try:
        url = server.url
        before = corrupt_reads(url)
        # REST by id: blocks 0-2
        for h in ids[0:3]:
            r = httpx.get(f"{url}/v1/blocks/{h}")
            if h in damaged:
                assert r.status_code == 404, (h, r.status_code)
            else:
                assert r.content == payload(bytes.fromhex(h))
        # REST batch: blocks 3-5
        batch = httpx.post(f"{url}/v1/blocks/batch", json={"hashes": ids[3:6]})
        for bid, got in decode_batch(batch.content):
            assert got == (None if bid.hex() in damaged else payload(bid))
        # stream: blocks 6-8
        with StreamClient.connect(discover(url), timeout=10) as client:
            got = client.load([bytes.fromhex(h) for h in ids[6:9]])
            for h, g in zip(ids[6:9], got, strict=True):
                assert (None if g is None else bytes(g)) == (
                    None if h in damaged else payload(bytes.fromhex(h))
                )
        # detected (at start-up recovery or on the read): counted or quarantined, never again
        quarantined = (
            list((data / "quarantine").iterdir()) if (data / "quarantine").exists() else []
        )
        quarantined += (
            list((data / "blocks" / "quarantine").glob("*"))
            if (data / "blocks" / "quarantine").exists()
            else []
        )
        assert corrupt_reads(url) - before + len(quarantined) >= len(damaged)
        for h in damaged:
            assert httpx.get(f"{url}/v1/blocks/{h}").status_code == 404
        # the chain lookup stops before the first damaged block
        out = httpx.post(f"{url}/v1/lookup", json={"namespace": NS, "tokens": toks}).json()
        assert out["matched_blocks"] <= 1
    finally:
        server.stop()
