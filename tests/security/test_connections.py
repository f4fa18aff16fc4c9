"""Half-open HTTP connections by the thousand, on a node with 1,024 descriptors: the node
keeps answering, no request gets a 500, and what it answered durable survives kill -9."""

from __future__ import annotations

import socket
import time

from tests.security.conftest import ALICE, BOB, NodeFactory, client

NS = {"model": "flood", "block_tokens": 4, "kv_dtype": "bf16", "kv_layout": "x"}
BLOCK = 64 << 10


def half_open(url: str, n: int) -> list[socket.socket]:
    """``n`` connections that send a request line and one header, and never finish."""
    host, port = url.removeprefix("http://").split(":")
    out: list[socket.socket] = []
    for _ in range(n):
        try:
            s = socket.create_connection((host, int(port)), timeout=5)
            s.setblocking(False)
            s.send(b"GET /v1/stats HTTP/1.1\r\nhost: 127.0.0.1\r\n")
        except OSError:
            continue  # the backlog was full for a moment: the flood goes on
        out.append(s)
    return out


def test_half_open_connections_neither_starve_nor_break_the_node(
    guarded_node: NodeFactory,
) -> None:
    node = guarded_node({"SESSIONCACHE_HTTP_HEAD_TIMEOUT_S": "10"}, nofile=1024)
    flood = half_open(node.url, 3000)
    assert len(flood) > 2000
    durable: list[list[int]] = []
    slowest = 0.0
    try:
        with client(node, BOB, timeout=10) as bob:
            for turn in range(10):
                started = time.monotonic()
                assert bob.get("/healthz").status_code == 200
                slowest = max(slowest, time.monotonic() - started)
                tokens = [turn * 1000 + i for i in range(8)]
                plan = bob.post("/v1/store", json={"namespace": NS, "tokens": tokens})
                assert plan.status_code == 200, plan.text
                for h in plan.json()["missing"]:
                    r = bob.put(f"/v1/blocks/{h}?durable=true", content=bytes([turn]) * BLOCK)
                    assert r.status_code < 500, r.text
                    assert r.status_code == 200 and r.json()["durable"], r.text
                durable.append(tokens)
                flood += half_open(node.url, 100)  # it never stops
        print(f"/healthz under {len(flood)} half-open connections: slowest {slowest * 1e3:.1f} ms")
        assert slowest < 2.0
    finally:
        for s in flood:
            s.close()
    log = node.server.log.read_text()
    assert "Traceback" not in log, log[-3000:]
    node.server.process.kill()  # kill -9: what was answered durable is on disk
    node.server.process.wait(10)
    again = guarded_node(data_dir=node.server.data_dir)
    with client(again, BOB) as bob, client(again, ALICE) as alice:
        for tokens in durable:
            r = bob.post("/v1/lookup", json={"namespace": NS, "tokens": tokens})
            assert r.json()["matched_blocks"] == 2, r.text
        assert (
            alice.post("/v1/lookup", json={"namespace": NS, "tokens": durable[0]}).json()[
                "matched_blocks"
            ]
            == 0
        )  # bob's blocks are not alice's
