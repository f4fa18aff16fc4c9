"""Connections that stall a request body, or hold more than a tenant's share of the REST
connection cap: the node closes them, and another tenant's requests keep being answered."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections import Counter

import httpx

from tests.security.conftest import ALICE, Guarded, NodeFactory, client, wait_until

NS = {"model": "stalled", "block_tokens": 4, "kv_dtype": "u8", "kv_layout": "x"}
QUERY = {"namespace": NS, "tokens": [1, 2, 3, 4]}
LOOKUP = json.dumps(QUERY).encode()
ADMIN_TOKEN = "admin-" + "token-of-the-stalled-bodies-tests"


def address(node: Guarded) -> tuple[str, int]:
    host, port = node.url.removeprefix("http://").split(":")
    return host, int(port)


def lookup_head(key: str, length: int) -> bytes:
    """A ``POST /v1/lookup`` head with ``key`` that announces a body of ``length`` bytes."""
    return (
        f"POST /v1/lookup HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\ncontent-length: {length}\r\n\r\n"
    ).encode()


def until_closed(s: socket.socket) -> bytes:
    """All a connection receives until the node closes it (its timeout fails the wait)."""
    got = b""
    while chunk := s.recv(4096):
        got += chunk
    return got


def status_of(answer: bytes) -> str:
    """The status code of a raw answer, or ``closed`` when the node closed without one."""
    return answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "closed"


class StalledBodies:
    """Bob's flood: ``n`` connections, each a lookup head with bob's key announcing 100 bytes
    of body that never come; each one the node closes is opened again at once. ``answers``
    counts what the closed ones got (``status_of``)."""

    def __init__(self, node: Guarded, n: int) -> None:
        self.address = address(node)
        self.n = n
        self.answers: Counter[str] = Counter()
        self.open: set[socket.socket] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StalledBodies:
        self._thread.start()
        deadline = time.monotonic() + 10
        while len(self.open) < self.n and time.monotonic() < deadline:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for s in self.open:
            s.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            for s in list(self.open):
                try:
                    answer = s.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    answer = b""
                self.open.discard(s)
                s.close()
                self.answers[status_of(answer)] += 1
            while len(self.open) < self.n and not self._stop.is_set():
                try:
                    s = socket.create_connection(self.address, timeout=2)
                    s.sendall(lookup_head("key-bob", 100))
                except OSError:
                    break  # the backlog is full for a moment: the flood goes on
                s.setblocking(False)
                self.open.add(s)
            self._stop.wait(0.02)


def test_stalled_bodies_at_the_cap_lock_no_tenant_out(guarded_node: NodeFactory) -> None:
    node = guarded_node(
        {"SESSIONCACHE_HTTP_BODY_FLOOR_S": "2", "SESSIONCACHE_HTTP_HEAD_TIMEOUT_S": "2"},
        nofile=512,  # a cap of 256 REST connections
    )
    served: list[float] = []
    statuses: Counter[int | str] = Counter()
    with StalledBodies(node, 300) as bob:
        for _ in range(20):
            started = time.monotonic()
            try:
                with client(node, ALICE, timeout=5) as alice:
                    status: int | str = alice.post("/v1/lookup", json=QUERY).status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            elapsed = time.monotonic() - started
            statuses[status] += 1
            if status == 200 and elapsed < 2.0:
                served.append(elapsed)
            time.sleep(0.1)
        answers = dict(bob.answers)
    print(
        f"bob: {bob.n} connections with stalled bodies, reopened as closed; "
        f"alice: {len(served)}/20 answered 200 within 2 s "
        f"({dict(statuses)}, slowest {max(served, default=0.0):.2f} s); "
        f"bob's closed connections got {answers}"
    )
    assert len(served) == 20, statuses
    assert answers.get("429", 0) > 0, answers  # past bob's share of the cap
    assert answers.get("408", 0) > 0, answers  # within it, but stalled past the grace
    assert "500" not in answers, answers
    assert "Traceback" not in node.server.log.read_text()


def test_a_stalled_body_is_answered_408_and_a_slow_steady_one_is_served(
    guarded_node: NodeFactory,
) -> None:
    node = guarded_node(
        {"SESSIONCACHE_HTTP_BODY_FLOOR_S": "1", "SESSIONCACHE_HTTP_BODY_MIN_BYTES_PER_S": "1024"}
    )
    padded = LOOKUP + b" " * (3000 - len(LOOKUP))
    with socket.create_connection(address(node), timeout=8) as bob:
        bob.sendall(lookup_head("key-bob", len(padded)) + padded[:10])
        with socket.create_connection(address(node), timeout=8) as alice:
            started = time.monotonic()
            alice.sendall(lookup_head("key-alice", len(padded)))
            for at in range(0, len(padded), 300):  # 2,000 bytes/s, above the least rate
                alice.sendall(padded[at : at + 300])
                time.sleep(0.15)
            alice_answer = alice.recv(4096)
            alice_took = time.monotonic() - started
        try:
            bob_answer = bob.recv(4096)
        except TimeoutError:
            bob_answer = b"no answer in 8 s"
        bob_took = time.monotonic() - started
    print(
        f"bob's stalled body: {bob_answer[:12]!r} after {bob_took:.2f} s; "
        f"alice's 3,000 bytes in {alice_took:.2f} s: {alice_answer[:12]!r}"
    )
    assert status_of(alice_answer) == "200", alice_answer
    assert alice_took > 1.0  # past the floor: the rate, not the floor, gave it its time
    assert status_of(bob_answer) == "408", bob_answer
    assert b"http_body_min_bytes_per_s" in bob_answer
    assert bob_took < 5.0


def stall(node: Guarded, n: int, into: list[socket.socket]) -> None:
    """``n`` of bob's lookups whose heads promise a body never sent, kept in ``into``."""
    for _ in range(n):
        s = socket.create_connection(address(node), timeout=5)
        s.sendall(lookup_head("key-bob", 100))
        into.append(s)


def test_at_the_cap_the_connection_stalled_longest_makes_room(guarded_node: NodeFactory) -> None:
    node = guarded_node(
        {
            "SESSIONCACHE_HTTP_MAX_CONNECTIONS": "20",
            "SESSIONCACHE_HTTP_TENANT_SHARE": "1",
            "SESSIONCACHE_HTTP_BODY_FLOOR_S": "60",
        }
    )
    bob: list[socket.socket] = []
    try:
        stall(node, 20, bob)
        time.sleep(0.5)  # every head read: the cap is full of stalled bodies
        with contextlib.ExitStack() as alice:  # 5 connections, kept open
            for _ in range(5):
                one = alice.enter_context(client(node, ALICE, timeout=5))
                assert one.post("/v1/lookup", json=QUERY).status_code == 200
        evicted = []
        for s in bob:
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):  # still open
                evicted.append(s.recv(4096))
    finally:
        for s in bob:
            s.close()
    print(f"alice's 5 connections at the cap closed {len(evicted)} of bob's stalled bodies")
    assert len(evicted) == 5, evicted
    for answer in evicted:
        assert status_of(answer) == "408" and b"http_max_connections" in answer, answer


def tenant_metrics(node: Guarded) -> str:
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    return httpx.get(f"{node.url}/metrics", headers=admin, timeout=10).text


def held(node: Guarded, tenant: str) -> float:
    """The REST connections ``tenant`` holds, as ``/metrics`` says."""
    series = f'sessioncache_tenant_held{{bound="http_connections",tenant="{tenant}"}} '
    for line in tenant_metrics(node).splitlines():
        if line.startswith(series):
            return float(line.removeprefix(series))
    return 0.0


def test_no_tenant_holds_more_than_its_share_of_the_cap(guarded_node: NodeFactory) -> None:
    node = guarded_node(
        {
            "SESSIONCACHE_HTTP_MAX_CONNECTIONS": "40",
            "SESSIONCACHE_HTTP_TENANT_SHARE": "0.5",
            "SESSIONCACHE_ADMIN_TOKEN": ADMIN_TOKEN,
        }
    )
    bob: list[socket.socket] = []
    try:
        stall(node, 20, bob)
        assert wait_until(lambda: held(node, "bob") == 20, 10), held(node, "bob")
        with socket.create_connection(address(node), timeout=5) as past:
            past.sendall(lookup_head("key-bob", 100))
            refused = until_closed(past)
        with client(node, ALICE) as alice:
            assert alice.post("/v1/lookup", json=QUERY).status_code == 200
        metrics = tenant_metrics(node)
    finally:
        for s in bob:
            s.close()
    print(f"bob's 21st connection: {refused[:12]!r}")
    assert status_of(refused) == "429", refused
    assert b"http_connections" in refused and b"QuotaExceeded" in refused
    assert 'sessioncache_tenant_held{bound="http_connections",tenant="bob"} 20.0' in metrics
    assert 'sessioncache_tenant_limit{bound="http_connections",tenant="bob"} 20.0' in metrics


NEXT_HEAD = b"GET /healthz HTTP/1.1\r\nx-slow: " + b"a" * 40


def test_an_idle_keep_alive_connection_has_the_head_deadline(guarded_node: NodeFactory) -> None:
    node = guarded_node({"SESSIONCACHE_HTTP_HEAD_TIMEOUT_S": "1"})
    with socket.create_connection(address(node), timeout=8) as bob:
        bob.sendall(lookup_head("key-bob", len(LOOKUP)) + LOOKUP)
        assert status_of(bob.recv(65536)) == "200"
        answered = time.monotonic()
        closed = False
        for byte in NEXT_HEAD:  # a byte of the next head every 0.1 s, never the whole head
            try:
                bob.sendall(bytes([byte]))
                closed = bob.recv(1, socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed = True
            if closed:
                break
            time.sleep(0.1)
        idle = time.monotonic() - answered
    with client(node, ALICE) as alice:
        assert alice.post("/v1/lookup", json=QUERY).status_code == 200
    print(f"a keep-alive connection trickling its next head was closed after {idle:.2f} s")
    assert closed and idle < 3.0
