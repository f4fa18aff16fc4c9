"""An engine's event feed costs the node only that engine's share: bob runs the publishers of
his engines (any sequence number, gaps, replay sockets that never answer) and alice's engine
is still followed promptly; an engine that starts after it was registered is caught up."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from tests.security.conftest import ALICE, BOB, NodeFactory, client, wait_until
from tests.support import vllm_events as ve
from tests.support.kv_engines import SimEngine
from tests.support.servers import free_port

MiB = 1 << 20
BLOCK = 16
LOOPBACK = {"SESSIONCACHE_ENGINE_ENDPOINT_PREFIXES": '["tcp://127.0.0.1:"]'}
"""The tests' engines run on this host (a keyed tenant's are off it by default)."""


def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def namespace() -> dict[str, Any]:
    return {
        "model": f"feeds-{uuid.uuid4().hex[:8]}",
        "block_tokens": BLOCK,
        "kv_dtype": "bf16",
        "kv_layout": "x",
    }


def prompt(seed: int, n: int = 4 * BLOCK) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50_000 for i in range(n)]


def one_batch(seed: int) -> bytes:
    """A batch storing one block, as vLLM encodes it."""
    event = ve.stored(False, [seed], None, prompt(seed, BLOCK), BLOCK)
    return msgspec.msgpack.encode(ve.batch(False, [event]))


class RawFeed:
    """A publisher sending the sequence numbers a test picks, and a replay socket bound at
    ``replay_endpoint`` that never answers."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.endpoint, self.replay_endpoint = endpoint(), endpoint()
        self._pub = ctx.socket(zmq.XPUB)  # sends as a PUB does, and shows the subscription
        self._pub.bind(self.endpoint)
        self._silent = ctx.socket(zmq.ROUTER)
        self._silent.bind(self.replay_endpoint)

    def wait_subscriber(self) -> None:
        assert self._pub.poll(30_000), "no subscriber"
        self._pub.recv()

    def send(self, seq: int, payload: bytes) -> None:
        self._pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    def close(self) -> None:
        self._pub.close(linger=0)
        self._silent.close(linger=0)


@pytest.fixture
def zctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def register(c: httpx.Client, ns: dict[str, Any], pub: str, rep: str | None) -> str:
    engine_id = f"eng-{uuid.uuid4().hex[:8]}"
    body = {"engine_id": engine_id, "namespace": ns, "endpoint": pub, "replay_endpoint": rep}
    r = c.post("/v1/engines", json=body)
    assert r.status_code == 201, r.text
    return engine_id


def last_seq(c: httpx.Client, engine_id: str) -> int | None:
    """The last sequence number the node applied (None, too, once the node is gone)."""
    try:
        seq: int | None = c.get(f"/v1/engines/{engine_id}").json()["last_seq"]
    except httpx.TransportError:
        return None
    return seq


def matched(c: httpx.Client, ns: dict[str, Any], tokens: list[int], engine_id: str) -> int:
    r = c.post("/v1/route", json={"namespace": ns, "tokens": tokens, "engines": [engine_id]})
    assert r.status_code == 200, r.text
    return int(r.json()["engines"][0]["matched_tokens"])


def test_a_far_sequence_number_allocates_nothing_in_proportion(
    guarded_node: NodeFactory, zctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    # bob's first message waits for the replay his connect asked for: briefly
    node = guarded_node({**LOOPBACK, "SESSIONCACHE_ENGINE_REPLAY_TIMEOUT_S": "0.5"}, limit=1 << 30)
    ns = namespace()
    feed = RawFeed(zctx)
    alice_pub = ve.Publisher(endpoint(), endpoint(), legacy=False)
    try:
        with client(node, BOB) as bob, client(node, ALICE) as alice:
            b = register(bob, ns, feed.endpoint, feed.replay_endpoint)
            feed.wait_subscriber()
            a = register(alice, ns, alice_pub.endpoint, alice_pub.replay_endpoint)
            alice_pub.wait_subscriber()
            before = node.settled_rss()
            feed.send(10**9, one_batch(1))
            synced = wait_until(lambda: last_seq(bob, b) == 10**9, 10)
            assert not node.killed, f"killed past {node.limit >> 20} MiB (peak {node.peak >> 20})"
            grown = node.settled_rss() - before
            began = time.monotonic()
            assert alice.get("/healthz").status_code == 200
            took = time.monotonic() - began
            print(f"seq 1e9: +{grown / MiB:.0f} MiB, /healthz in {took * 1000:.0f} ms")
            assert synced
            assert grown < 100 * MiB, f"the node grew by {grown >> 20} MiB"
            assert took < 1.0
            status = bob.get(f"/v1/engines/{b}").json()
            assert (status["replays"], status["stale"]) == (0, False)  # no replay could reach
            engine = SimEngine(BLOCK, False, alice_pub)
            engine.cache(prompt(2))
            assert wait_until(lambda: matched(alice, ns, prompt(2), a) == 4 * BLOCK, 10)
    finally:
        feed.close()
        alice_pub.close()


def test_silent_replays_of_gapped_engines_delay_only_their_own_engine(
    guarded_node: NodeFactory, zctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    node = guarded_node(LOOPBACK)
    ns = namespace()
    feeds = [RawFeed(zctx) for _ in range(3)]
    alice_pub = ve.Publisher(endpoint(), endpoint(), legacy=False)
    try:
        with client(node, BOB) as bob, client(node, ALICE) as alice:
            bobs = [register(bob, ns, f.endpoint, f.replay_endpoint) for f in feeds]
            for f in feeds:
                f.wait_subscriber()
            a = register(alice, ns, alice_pub.endpoint, alice_pub.replay_endpoint)
            alice_pub.wait_subscriber()
            stop = threading.Event()

            def gapped() -> None:
                """A gapped message from each of bob's engines every 0.2 s."""
                seq = 1
                while not stop.wait(0.2):
                    for f in feeds:
                        f.send(seq, one_batch(seq))
                    seq += 2

            sender = threading.Thread(target=gapped)
            sender.start()
            try:
                time.sleep(1)  # bob's replays pile up
                engine = SimEngine(BLOCK, False, alice_pub)
                latencies: list[float] = []
                for i in range(8):
                    tokens = prompt(100 + i)
                    engine.cache(tokens)
                    began = time.monotonic()
                    seen = wait_until(lambda t=tokens: matched(alice, ns, t, a) == len(t), 3)
                    latencies.append(time.monotonic() - began)
                    print(f"alice's event {i}: seen {seen}, after {latencies[-1]:.2f} s")
                    assert seen, f"alice's event {i} not in /v1/route within 3 s"
                    time.sleep(0.1)
                listed = {e["engine_id"]: e for e in bob.get("/v1/engines").json()["engines"]}
            finally:
                stop.set()
                sender.join()
            assert max(latencies) < 2.0, latencies
            assert all(listed[b]["stale"] for b in bobs)  # behind: a replay is pending
            assert alice.get(f"/v1/engines/{a}").json()["stale"] is False
    finally:
        for f in feeds:
            f.close()
        alice_pub.close()


def test_an_engine_that_starts_after_its_registration_is_caught_up(
    guarded_node: NodeFactory,
) -> None:
    node = guarded_node(LOOPBACK)
    ns = namespace()
    pub, rep = endpoint(), endpoint()
    bob_pub, bob_rep = endpoint(), endpoint()
    with client(node, ALICE) as alice, client(node, BOB) as bob:
        a = register(alice, ns, pub, rep)
        register(bob, ns, bob_pub, bob_rep)  # never starts: dialled alongside
        time.sleep(4.5)  # the node redials both dead endpoints meanwhile
        publisher = ve.Publisher(pub, rep, legacy=False)
        try:
            engine = SimEngine(BLOCK, False, publisher)
            engine.cache(prompt(7))  # one request, published before the node connects; then idle
            began = time.monotonic()
            routed = wait_until(lambda: matched(alice, ns, prompt(7), a) == 4 * BLOCK, 10)
            print(f"routed: {routed}, after {time.monotonic() - began:.2f} s")
            assert routed
        finally:
            publisher.close()
