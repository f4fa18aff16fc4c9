"""What a client sends costs the node what it holds, not what it declares: tiny blocks, big
declared bodies and big JSON before the key is checked."""

from __future__ import annotations

from sessioncache.connector import StreamClient
from sessioncache.hashing import Namespace
from tests.security.conftest import ALICE, BOB, NodeFactory, client

MiB = 1 << 20
TINY = {
    "SESSIONCACHE_CPU_BYTES": str(256 * MiB),
    "SESSIONCACHE_DISK_BYTES": "0",
}


def tiny_ns(i: int, block_tokens: int = 1) -> dict[str, object]:
    return {"model": "tiny", "block_tokens": block_tokens, "kv_dtype": "u8", "kv_layout": f"t{i}"}


def test_blocks_of_a_few_bytes_cost_the_node_no_memory_of_their_slots(
    guarded_node: NodeFactory,
) -> None:
    node = guarded_node(TINY)
    with client(node, BOB) as bob:
        # warm-up: a first ordinary store makes the tier's first chunk and its two spares
        plan = bob.post("/v1/store", json={"namespace": tiny_ns(0, 16), "tokens": [1] * 16})
        r = bob.put(f"/v1/blocks/{plan.json()['missing'][0]}", content=b"w" * (64 << 10))
        assert r.status_code == 200, r.text
    before = node.rss()
    with client(node, BOB) as bob:
        # 1-byte blocks: a slab of 1-byte slots, whose first chunk has 64 Mi of them
        plan = bob.post("/v1/store", json={"namespace": tiny_ns(1), "tokens": [7]}).json()
        r = bob.put(f"/v1/blocks/{plan['missing'][0]}", content=b"x")
        assert r.status_code == 200, r.text
    with StreamClient.discover(node.url, api_key="key-alice") as alice:
        ns = Namespace("tiny", 1, "u8", "stream")
        root = alice.resolve(ns)
        ack = alice.store(root, list(range(4096)), [b"\x01"] * 4096)
        assert ack.kept == 4096
    assert not node.killed
    grown = node.rss() - before
    print(f"1-byte blocks: the node grew by {grown >> 20} MiB (peak {node.peak >> 20} MiB)")
    assert grown < 200 * MiB, f"the node grew by {grown >> 20} MiB"
    with client(node, ALICE) as c:
        assert c.get("/healthz").status_code == 200
