"""A full CPU tier whose blocks are on their way to disk, on a disk another process keeps
busy: stores through ``KVTransfer.store_from`` (same host and stream) wait for the
write-behind to make room, and every block is kept."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from sessioncache.connector import SessionCacheClient
from sessioncache.connector.transfer import KVTransfer
from sessioncache.hashing import Namespace
from tests.support.servers import Server, start_server

BLOCK = 256 * 1024
BLOCK_TOKENS = 16
CHAIN = 16  # 4 MiB: a quarter of the tier
CHAINS = 12  # per path: three times the tier
NODE = {
    "SESSIONCACHE_CPU_BYTES": str(16 << 20),
    "SESSIONCACHE_DISK_BYTES": str(1 << 30),
    "SESSIONCACHE_DURABLE_UPLOADS": "false",
}
WRITER = """
import os, sys
chunk = os.urandom(1 << 20)
while True:
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for _ in range(64):
        os.write(fd, chunk)
    os.fdatasync(fd)
    os.close(fd)
"""


@pytest.fixture(params=["1.0", "0.5"], ids=["whole-tier", "pin-share"])
def busy_node(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Server]:
    """A node whose data dir's disk another process writes to, each file ``fdatasync``-ed.
    With a tenant pin share of 1.0 one tenant may stage the whole tier (eviction alone is
    tested); at the default 0.5, the blocks the write-behind is copying must not count in
    the tenant's pins (they are the node's own copies, and leave)."""
    env = {**NODE, "SESSIONCACHE_TENANT_PIN_SHARE": request.param}
    server = start_server(tmp_path / "data", env)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "data" / "junk")])
    try:
        yield server
    finally:
        writer.kill()
        writer.wait(10)
        server.stop()


@pytest.mark.timeout(240)
def test_stores_into_a_tier_waiting_for_a_busy_disk_keep_every_block(busy_node: Server) -> None:
    rng = np.random.default_rng(7)
    blocks = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(CHAIN)]
    kept: dict[str, list[int]] = {}
    for path in ("same_host", "stream"):
        namespace = Namespace(f"room-{path}", BLOCK_TOKENS, "u8", "x")
        client = SessionCacheClient(busy_node.url, namespace=namespace, timeout=120)
        kv = KVTransfer(client, path=path)  # type: ignore[arg-type]
        try:
            for _ in range(CHAINS):
                tokens = [int(t) for t in rng.integers(0, 50_000, BLOCK_TOKENS * CHAIN)]
                kept.setdefault(path, []).append(kv.store_from(tokens, blocks).blocks)
        finally:
            kv.close()
            client.close()
    assert kept == {"same_host": [CHAIN] * CHAINS, "stream": [CHAIN] * CHAINS}
    metrics = httpx.get(busy_node.url + "/metrics", timeout=30).text
    assert "sessioncache_dropped_blocks_total 0.0" in metrics
