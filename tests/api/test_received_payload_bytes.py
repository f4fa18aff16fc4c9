"""``sessioncache_received_payload_bytes_total``: the block payload bytes each carrier
received, node-wide, on the anonymous ``/metrics``."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from sessioncache.connector import SessionCacheClient
from sessioncache.connector.transfer import KVTransfer
from sessioncache.hashing import Namespace
from tests.support.servers import Server, start_server

BLOCK = 64 * 1024
CARRIERS = ("rest", "stream", "same_host")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("received") / "data")
    yield server
    server.stop()


def received(node: Server) -> dict[str, int]:
    text = httpx.get(f"{node.url}/metrics", timeout=10).text
    series = r'^sessioncache_received_payload_bytes_total\{carrier="(\w+)"\} (\S+)$'
    found = dict(re.findall(series, text, re.M))
    assert set(found) == set(CARRIERS), text
    return {carrier: int(float(n)) for carrier, n in found.items()}


@pytest.mark.parametrize("path", CARRIERS)
def test_each_carrier_counts_the_payload_bytes_it_received(node: Server, path: str):
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 50_000, 16 * 5 + 3)]
    rng = np.random.default_rng(2)
    blocks = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(5)]
    namespace = Namespace(f"m-{path}", 16, "bf16", "x")
    client = SessionCacheClient(node.url, namespace=namespace)
    with client, KVTransfer(client, path=path) as kv:  # type: ignore[arg-type]
        before = received(node)
        kv.store_from(tokens, blocks)
        after = received(node)
        assert after[path] - before[path] == 5 * BLOCK
        assert all(after[c] == before[c] for c in CARRIERS if c != path)
        kv.store_from(tokens + [1] * 16, [*blocks, blocks[0]])  # five held, one new
        again = received(node)
    if path == "stream":  # a STORE carries every payload it names
        assert again[path] - after[path] == 6 * BLOCK
    else:  # a block the node holds is never sent (REST) or written (same host)
        assert again[path] - after[path] == BLOCK
