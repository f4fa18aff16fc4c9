"""Bad input gets a 4xx with a message, never a 500 or a traceback in the node's log; an open
node answers only requests addressed to it; a body is read only for a known key."""

from __future__ import annotations

import json
import socket
import struct
import time

import httpx

from sessioncache.connector import StreamClient
from sessioncache.dataplane.frames import HEADER_SIZE, Op, decode_header, encode_header
from sessioncache.dataplane.transport import parse_address
from tests.security.conftest import ALICE, BOB, Guarded, NodeFactory, client

NS = {"model": "bad", "block_tokens": 4, "kv_dtype": "bf16", "kv_layout": "x"}


def raw(node: Guarded, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    """A POST whose JSON body is sent as is (``Infinity`` and ``1e400`` included)."""
    with client(node, headers) as c:
        return c.post(path, content=body, headers={"content-type": "application/json"})


def no_tracebacks(node: Guarded) -> None:
    log = node.server.log.read_text()
    assert "Traceback" not in log and "RecursionError" not in log, log[-3000:]


def test_numbers_out_of_range_are_422(guarded_node: NodeFactory) -> None:
    node = guarded_node()
    tokens = json.dumps(list(range(8)))
    ns = json.dumps(NS)
    lookup = f'{{"namespace": {ns}, "tokens": {tokens}, "lease_ms": {"9" * 312}}}'
    r = raw(node, "/v1/lookup", lookup.encode(), ALICE)
    assert r.status_code == 422, r.text
    for ttl in ("Infinity", "1e400", "NaN", "1e300"):
        store = f'{{"namespace": {ns}, "tokens": {tokens}, "ttl_s": {ttl}}}'
        assert raw(node, "/v1/store", store.encode(), ALICE).status_code == 422, ttl
        opened = raw(node, "/v1/sessions", f'{{"ttl_s": {ttl}}}'.encode(), ALICE)
        assert opened.status_code == 422, (ttl, opened.text)
    with client(node, ALICE) as c:
        sid = c.post("/v1/sessions", json={}).json()["id"]
    for ttl in ("Infinity", "1e400"):
        r = raw(node, f"/v1/sessions/{sid}/extend", f'{{"ttl_s": {ttl}}}'.encode(), ALICE)
        assert r.status_code == 422, (ttl, r.text)
    deep = b"[" * 100_000 + b"]" * 100_000
    r = raw(node, "/v1/lookup", b'{"namespace": ' + deep + b"}", ALICE)
    assert 400 <= r.status_code < 500, r.text
    with client(node, BOB) as bob:  # alice's bad input costs bob nothing
        assert bob.post("/v1/lookup", json={"namespace": NS, "tokens": list(range(8))}).is_success
    no_tracebacks(node)


def test_a_hello_nested_deep_is_refused_without_a_traceback(guarded_node: NodeFactory) -> None:
    node = guarded_node()
    with client(node, ALICE) as c:
        host, port = parse_address(c.get("/v1/dataplane").json()["stream"])
    body = b"[" * 1000 + b"]" * 1000
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(encode_header(Op.HELLO, 1, len(body)) + body)
        head = s.recv(HEADER_SIZE, socket.MSG_WAITALL)
        assert decode_header(head, requests=False).opcode is Op.ERROR
        (code,) = struct.unpack_from("<H", s.recv(2, socket.MSG_WAITALL))
        assert code == 2  # MALFORMED
    with StreamClient.discover(node.url, api_key="key-bob") as bob:  # the stream still serves
        assert bob.tenant == "bob"
    no_tracebacks(node)


def test_an_open_node_answers_only_requests_addressed_to_it(guarded_node: NodeFactory) -> None:
    node = guarded_node({"SESSIONCACHE_API_KEYS": "{}"})
    with httpx.Client(base_url=node.url, timeout=10) as c:
        assert c.get("/v1/stats").status_code == 200
        assert c.get("/v1/stats", headers={"host": "localhost:1"}).status_code == 200
        rebound = c.get("/v1/stats", headers={"host": "attacker.example:8080"})
        assert rebound.status_code == 403 and rebound.json()["error"] == "HostRefused"
        page = c.post("/v1/gc", headers={"origin": "http://attacker.example"})
        assert page.status_code == 403, page.text
        token = c.get("/admin/api/session", headers={"host": "attacker.example"})
        assert token.status_code == 403  # the CSRF token is not handed to a rebound page


def test_engines_are_bounded_per_tenant(guarded_node: NodeFactory) -> None:
    node = guarded_node(
        {
            "SESSIONCACHE_MAX_ENGINES_PER_TENANT": "4",
            "SESSIONCACHE_ENGINE_ENDPOINT_PREFIXES": json.dumps(["tcp://127.0.0.1:"]),
        }
    )

    def register(c: httpx.Client, i: int, port: int = 1) -> httpx.Response:
        endpoint = f"tcp://127.0.0.1:{port + i}"
        return c.post(
            "/v1/engines", json={"engine_id": f"e{i}", "namespace": NS, "endpoint": endpoint}
        )

    with client(node, BOB) as bob, client(node, ALICE) as alice:
        assert [register(bob, i).status_code for i in range(4)] == [201] * 4
        refused = register(bob, 4)
        assert refused.status_code == 429 and refused.json()["error"] == "QuotaExceeded"
        assert register(alice, 0, 101).status_code == 201  # bob's engines are not alice's bound
        assert bob.delete("/v1/engines/e0").status_code == 204
        assert register(bob, 4).status_code == 201


def test_a_body_is_not_read_before_its_key_is_checked(guarded_node: NodeFactory) -> None:
    node = guarded_node()
    host, port = node.url.removeprefix("http://").split(":")
    declared = 250 << 20
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST /v1/lookup HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            + f"content-length: {declared}\r\n\r\n".encode()
            + b" " * (1 << 20)
        )
        started = time.monotonic()
        answer = s.recv(4096)
        took = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
        print(f"a 250 MB body without a key: 401 after {took * 1e3:.1f} ms")
        assert took < 2
    with client(node, ALICE) as c:  # a known key, a body over the JSON routes' limit
        r = c.post("/v1/lookup", content=b" " * (33 << 20))
        assert r.status_code == 413 and r.json()["error"] == "BodyTooLarge"
    assert node.peak < 1 << 30
