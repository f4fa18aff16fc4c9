"""What a client sends costs the node what it holds, not what it declares: tiny blocks, big
declared bodies and big JSON before the key is checked."""

from __future__ import annotations

import socket
import struct
import time

from sessioncache.connector import StreamClient
from sessioncache.dataplane import frames
from sessioncache.hashing import Namespace
from tests.security.conftest import ALICE, BOB, Guarded, NodeFactory, client

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
    before = node.settled_rss()
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
    grown = node.settled_rss() - before
    print(f"1-byte blocks: the node grew by {grown >> 20} MiB (peak {node.peak >> 20} MiB)")
    assert grown < 200 * MiB, f"the node grew by {grown >> 20} MiB"
    with client(node, ALICE) as c:
        assert c.get("/healthz").status_code == 200


def put_head(node: Guarded, key: str, block: str, declared: int) -> bytes:
    host, port = node.url.removeprefix("http://").split(":")
    return (
        f"PUT /v1/blocks/{block} HTTP/1.1\r\nhost: {host}:{port}\r\n"
        f"authorization: Bearer {key}\r\ncontent-type: application/octet-stream\r\n"
        f"content-length: {declared}\r\n\r\n"
    ).encode()


def connect(node: Guarded) -> socket.socket:
    host, port = node.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def test_a_declared_body_costs_only_what_was_sent(guarded_node: NodeFactory) -> None:
    declared = 256 * MiB
    node = guarded_node({"SESSIONCACHE_MAX_BODY_BYTES": str(declared)})
    with client(node, BOB) as bob:
        ns = tiny_ns(9, 1)
        ids = bob.post("/v1/store", json={"namespace": ns, "tokens": list(range(6))}).json()
    before = node.rss()
    held: list[object] = []
    for h in ids["missing"]:  # 6 REST uploads that declare 256 MiB and send 10 bytes
        s = connect(node)
        s.sendall(put_head(node, "key-bob", h, declared) + b"0123456789")
        held.append(s)
    for _ in range(4):  # 4 stream STOREs of one declared 256 MiB block, 10 bytes sent
        alice = StreamClient.discover(node.url, api_key="key-alice")
        root = alice.resolve(Namespace("tiny", 1, "u8", "declared"))
        head = frames.StoreHead(root, None, 1, 1, declared)
        frame = frames.encode_store_head(99, head, struct.pack("<I", 5))
        alice._c.transport.send([frame, b"0123456789"])
        held.append(alice)
    time.sleep(1.0)
    grown = node.rss() - before
    print(f"6 REST + 4 stream bodies declared at 256 MiB: the node grew by {grown >> 20} MiB")
    assert grown < 300 * MiB and not node.killed
    with client(node, ALICE) as c:
        assert c.get("/healthz").status_code == 200
    for h in held:
        h.close()  # type: ignore[attr-defined]


def test_one_tenants_uploads_in_flight_are_bounded_and_not_the_others(
    guarded_node: NodeFactory,
) -> None:
    node = guarded_node({"SESSIONCACHE_TENANT_INFLIGHT_BYTES": str(4 * MiB)})
    with client(node, BOB) as bob:
        ids = bob.post("/v1/store", json={"namespace": tiny_ns(7, 1), "tokens": [1, 2, 3]})
        bob_ids = ids.json()["missing"]
    open_: list[socket.socket] = []
    for h in bob_ids[:2]:  # two uploads of 2 MiB, 1.5 MiB sent: 2 MiB of buffer each
        s = connect(node)
        s.sendall(put_head(node, "key-bob", h, 2 * MiB) + b"b" * (3 * MiB // 2))
        open_.append(s)
    time.sleep(0.5)
    s = connect(node)
    s.sendall(put_head(node, "key-bob", bob_ids[2], 2 * MiB) + b"b" * (3 * MiB // 2))
    answer = s.recv(4096)
    while b"}" not in answer:  # the body may come in a second segment
        answer += s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 429") and b"QuotaExceeded" in answer, answer[:300]
    s.close()
    with client(node, ALICE) as alice:  # bob's bound is not alice's
        plan = alice.post("/v1/store", json={"namespace": tiny_ns(7, 1), "tokens": [1]}).json()
        r = alice.put(f"/v1/blocks/{plan['missing'][0]}", content=b"a" * (2 * MiB))
        assert r.status_code == 200, r.text
    for s in open_:
        s.close()


def test_an_upload_not_handed_out_is_refused_before_its_body(guarded_node: NodeFactory) -> None:
    node = guarded_node()
    with client(node, ALICE) as alice:  # alice's id, which bob was never handed
        plan = alice.post("/v1/store", json={"namespace": tiny_ns(3, 1), "tokens": [9]}).json()
    with connect(node) as s:
        s.sendall(put_head(node, "key-bob", plan["missing"][0], 2 * MiB))  # no body sent
        s.settimeout(5)
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 403"), answer[:200]
