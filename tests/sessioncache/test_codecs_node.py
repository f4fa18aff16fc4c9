"""Codecs through a real node: a tenant's lossless setting stores its blocks smaller on disk
and reads them back byte-exact after a restart; a namespace that asks for int8 gets lossy
blocks back from disk, and the same tokens asked under an exact namespace never reach them;
a bad ``kv_codec`` is a 4xx that says what it takes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import numpy as np
import torch

from sessioncache.connector import StreamClient, discover
from sessioncache.hashing import Namespace
from sessioncache.tiers.disk import HEADER_SIZE, decode_header
from tests.support.servers import DURABLE_NODE, Server, start_server

KEYS = {"key-acme": "acme", "key-globex": "globex"}
METRICS_TOKEN = "metrics-token-of-the-codec-tests"
EXACT = Namespace("codec-node", 16, "bf16", "x")
LOSSY = Namespace("codec-node", 16, "bf16", "x", kv_codec="int8/64")
BLOCK = 64 * 1024


def node(data: Path) -> Server:
    return start_server(
        data,
        {
            **DURABLE_NODE,  # answered once on disk: what a restarted node reads back
            "SESSIONCACHE_API_KEYS": json.dumps(KEYS),
            "SESSIONCACHE_METRICS_TOKEN": METRICS_TOKEN,
            "SESSIONCACHE_TENANT_CODECS": json.dumps({"acme": "lossless"}),
        },
    )


def client(server: Server, key: str) -> StreamClient:
    return StreamClient.connect(discover(server.url, api_key=key), api_key=key, timeout=30)


def kv(seed: int, blocks: int) -> list[np.ndarray]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(blocks * BLOCK // 2, generator=gen) * 0.5).to(torch.bfloat16)
    return list(x.view(torch.uint8).numpy().reshape(blocks, BLOCK))


def tokens(seed: int, blocks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, 16 * blocks).astype(np.uint32)


def codecs_on_disk(data: Path) -> dict[int, int]:
    found: dict[int, int] = {}
    for path in (data / "blocks").rglob("*.blk"):
        head = decode_header(path.read_bytes()[:HEADER_SIZE])
        found[head.codec] = found.get(head.codec, 0) + 1
    return found


def test_codecs_from_the_tenant_and_the_namespace_survive_a_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = node(data)
    exact_blocks, lossy_blocks = kv(1, 4), kv(2, 4)
    try:
        with client(server, "key-acme") as acme:
            root = acme.resolve(EXACT)
            assert acme.store(root, tokens(1, 4), exact_blocks, durable=True).kept == 4
        with client(server, "key-globex") as globex:
            root = globex.resolve(LOSSY)
            assert globex.store(root, tokens(2, 4), lossy_blocks, durable=True).kept == 4
        # what each namespace's blocks take on disk, by codec
        bearer = {"authorization": f"Bearer {METRICS_TOKEN}"}
        scrape = httpx.get(f"{server.url}/metrics", headers=bearer, timeout=10).text
        ratios = {}
        for labels, value in re.findall(
            r"^sessioncache_tier_compression_ratio\{([^}]*)\} ([\d.e+]+)$", scrape, re.M
        ):
            fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            if fields["tier"] == "disk":
                ratios[fields["codec"]] = float(value)
        assert ratios["int8/64"] > 1.9 and ratios["lossless"] > 1.0, ratios
    finally:
        server.stop()
    assert codecs_on_disk(data) == {1: 4, 2: 4}  # lossless for acme, int8 asked
    server = node(data)  # its CPU tier starts empty: every load below reads the disk
    try:
        with client(server, "key-acme") as acme:
            root = acme.resolve(EXACT)
            got = acme.load(acme.block_hashes(root, tokens(1, 4)))
            assert got == [bytes(b) for b in exact_blocks]  # byte-exact
        with client(server, "key-globex") as globex:
            root = globex.resolve(LOSSY)
            got = globex.load(globex.block_hashes(root, tokens(2, 4)))
            assert all(g is not None for g in got)
            for g, b in zip(got, lossy_blocks, strict=True):
                assert g != bytes(b)
                y = torch.frombuffer(bytearray(g), dtype=torch.bfloat16).float()  # type: ignore[arg-type]
                x = torch.from_numpy(b.copy()).view(torch.bfloat16).float()
                assert (y - x).abs().max() < 0.05
            # the same tokens under an exact namespace: other ids, none held, never lossy
            exact = globex.resolve(EXACT)
            assert globex.lookup(exact, globex.block_hashes(exact, tokens(2, 4))).matched == 0
    finally:
        server.stop()


def test_a_bad_codec_is_a_4xx_that_says_what_it_takes(tmp_path: Path) -> None:
    server = node(tmp_path / "data")
    try:
        for codec in ("int8", "int8/0", "zstd", "fp8/64x"):
            reply = httpx.post(
                f"{server.url}/v1/namespaces/resolve",
                json={"namespace": {**EXACT.as_json(), "kv_codec": codec}},
                headers={"authorization": "Bearer key-acme"},
                timeout=10,
            )
            assert 400 <= reply.status_code < 500, reply.text
            assert "kv_codec" in reply.text
        reply = httpx.post(
            f"{server.url}/v1/namespaces/resolve",
            json={"namespace": LOSSY.as_json()},
            headers={"authorization": "Bearer key-acme"},
            timeout=10,
        )
        assert reply.status_code == 200, reply.text
    finally:
        server.stop()
