"""Per-tenant bounds: one tenant's uploads, connections or silence never cancel, lock out or
starve another's."""

from __future__ import annotations

import json
import socket
import struct
import time

import httpx
import pytest

from sessioncache.connector import SameHostClient, StreamClient
from sessioncache.connector.samehost import _abort
from sessioncache.dataplane import frames
from sessioncache.dataplane.frames import Op
from sessioncache.errors import InvalidInput, QuotaExceeded, StreamClosed
from sessioncache.hashing import Namespace
from sessioncache.status import BlockStatus
from tests.security.conftest import ALICE, BOB, METRICS, Guarded, NodeFactory, client

NS = {"model": "bounds", "block_tokens": 1, "kv_dtype": "u8", "kv_layout": "x"}


def test_upload_slots_are_bounded_per_tenant_and_never_taken_from_another(
    guarded_node: NodeFactory,
) -> None:
    node = guarded_node(
        {
            "SESSIONCACHE_TENANT_UPLOAD_SLOTS": "1000",
            "SESSIONCACHE_TENANT_LIMITS": json.dumps({"carol": {"upload_slots": 5}}),
        }
    )
    with client(node, BOB) as bob, client(node, ALICE) as alice:
        bob_plan = bob.post("/v1/store", json={"namespace": NS, "tokens": list(range(10))})
        assert bob_plan.status_code == 200
        flood = alice.post("/v1/store", json={"namespace": NS, "tokens": list(range(1001))})
        assert flood.status_code == 429 and flood.json()["error"] == "QuotaExceeded", flood.text
        assert "upload_slots" in flood.json()["detail"]
        within = alice.post("/v1/store", json={"namespace": NS, "tokens": list(range(990))})
        assert within.status_code == 200
        for i, h in enumerate(bob_plan.json()["missing"]):  # bob's slots are all still his
            r = bob.put(f"/v1/blocks/{h}", content=bytes([i]) * 64)
            assert r.status_code == 200, r.text
        more = alice.post("/v1/store", json={"namespace": NS, "tokens": list(range(500, 600))})
        assert more.status_code == 429  # 990 open and unused: refused, not evicted
        metrics = alice.get("/metrics", headers=METRICS).text
        assert 'sessioncache_tenant_held{bound="upload_slots",tenant="alice"} 990.0' in metrics
        assert 'sessioncache_tenant_limit{bound="upload_slots",tenant="alice"} 1000.0' in metrics


def silent(node_url: str, port: int, n: int) -> list[socket.socket]:
    """``n`` connections that say nothing."""
    host = node_url.removeprefix("http://").split(":")[0]
    return [socket.create_connection((host, port), timeout=5) for _ in range(n)]


def stream_port(node: Guarded) -> int:
    with client(node, BOB) as c:
        return int(c.get("/v1/dataplane").json()["stream"].rsplit(":", 1)[1])


def test_silent_and_trickling_sockets_never_lock_the_stream(guarded_node: NodeFactory) -> None:
    node = guarded_node()
    port = stream_port(node)
    quiet = silent(node.url, port, 64)  # never a HELLO
    trickle = silent(node.url, port, 1)[0]
    try:
        started = time.monotonic()
        with StreamClient.discover(node.url, api_key="key-bob", timeout=10) as bob:
            root = bob.resolve(Namespace("bounds", 1, "u8", "stream"))
            assert bob.store(root, [1, 2, 3], [b"b" * 64] * 3).kept == 3
        took = time.monotonic() - started
        print(f"a client among 65 silent stream connections: connected and stored in {took:.2f} s")
        assert took < 5
        opened = time.monotonic()
        closed_after = None
        for _ in range(12):  # a HELLO header trickled a byte a second, never whole
            try:
                if trickle.recv(1, socket.MSG_DONTWAIT) == b"":
                    closed_after = time.monotonic() - opened
                    break
            except BlockingIOError:
                pass
            except OSError:
                closed_after = time.monotonic() - opened
                break
            try:
                trickle.send(b"S")
            except OSError:
                closed_after = time.monotonic() - opened
                break
            time.sleep(1.0)
        print(f"a HELLO trickled a byte a second: closed after {closed_after:.1f} s")
        assert closed_after is not None and closed_after < 8
    finally:
        for s in [*quiet, trickle]:
            s.close()


def test_stream_connections_are_bounded_per_tenant(guarded_node: NodeFactory) -> None:
    node = guarded_node(
        {"SESSIONCACHE_TENANT_LIMITS": json.dumps({"bob": {"stream_connections": 2}})}
    )
    held = [StreamClient.discover(node.url, api_key="key-bob") for _ in range(2)]
    try:
        with pytest.raises((QuotaExceeded, StreamClosed)):
            StreamClient.discover(node.url, api_key="key-bob")
        alice = StreamClient.discover(node.url, api_key="key-alice")  # bob's bound is his own
        alice.close()
        held.pop().close()
        time.sleep(0.2)
        held.append(StreamClient.discover(node.url, api_key="key-bob"))  # room again
    finally:
        for c in held:
            c.close()


def test_namespaces_are_bounded_per_tenant_on_every_carrier_and_after_a_restart(
    guarded_node: NodeFactory,
) -> None:
    env = {"SESSIONCACHE_TENANT_LIMITS": json.dumps({"alice": {"namespaces": 5}})}
    node = guarded_node(env)

    def ns(i: int) -> dict[str, object]:
        return {**NS, "kv_layout": f"layout-{i}"}

    def lookup(c: httpx.Client, i: int) -> int:
        return c.post("/v1/lookup", json={"namespace": ns(i), "tokens": [1]}).status_code

    with StreamClient.discover(node.url, api_key="key-alice") as alice_stream:
        with pytest.raises(InvalidInput, match="model"):  # REST's field limits, on the stream
            alice_stream.resolve(Namespace("m" * 60_000, 1, "u8", "x"))
        for i in range(3):
            alice_stream.resolve(Namespace("bounds", 1, "u8", f"layout-{i}"))
    with client(node, ALICE) as alice, client(node, BOB) as bob:
        for i in range(3, 5):
            assert (
                alice.post("/v1/lookup", json={"namespace": ns(i), "tokens": [1]}).status_code
                == 200
            )
        over = alice.post("/v1/lookup", json={"namespace": ns(5), "tokens": [1]})
        assert over.status_code == 429 and "namespaces" in over.json()["detail"], over.text
        assert alice.post("/v1/lookup", json={"namespace": ns(0), "tokens": [1]}).status_code == 200
        for i in range(8):  # bob's namespaces are not alice's bound
            assert (
                bob.post("/v1/lookup", json={"namespace": ns(i), "tokens": [1]}).status_code == 200
            )
    node.stop()
    again = guarded_node(env, data_dir=node.server.data_dir)
    with client(again, ALICE) as alice:  # the catalog remembers whose roots are whose
        assert lookup(alice, 6) == 429
    with (
        StreamClient.discover(again.url, api_key="key-alice") as alice_stream,
        pytest.raises(QuotaExceeded),
    ):
        alice_stream.resolve(Namespace("bounds", 1, "u8", "layout-7"))


def test_open_sessions_are_bounded_per_tenant(guarded_node: NodeFactory) -> None:
    node = guarded_node({"SESSIONCACHE_TENANT_LIMITS": json.dumps({"bob": {"sessions": 3}})})
    with client(node, BOB) as bob, client(node, ALICE) as alice:
        ids = [bob.post("/v1/sessions", json={}).json()["id"] for _ in range(3)]
        over = bob.post("/v1/sessions", json={})
        assert over.status_code == 429 and "sessions" in over.json()["detail"], over.text
        assert bob.post("/v1/sessions", json={"session_id": ids[0]}).status_code == 201  # his own
        assert all(alice.post("/v1/sessions", json={}).status_code == 201 for _ in range(5))
        assert bob.delete(f"/v1/sessions/{ids[0]}").status_code == 204
        assert bob.post("/v1/sessions", json={}).status_code == 201  # room again


def test_one_tenants_leases_pin_at_most_its_share_and_the_other_still_stores(
    guarded_node: NodeFactory,
) -> None:
    mib = 1 << 20
    node = guarded_node(
        {
            "SESSIONCACHE_CPU_BYTES": str(8 * mib),
            "SESSIONCACHE_DISK_BYTES": "0",
            "SESSIONCACHE_MAX_BODY_BYTES": str(2 * mib),
            "SESSIONCACHE_CPU_SPARE_CHUNKS": "0",
        }
    )
    ns = {**NS, "kv_layout": "pins"}
    with client(node, ALICE) as alice, client(node, BOB) as bob:
        for i in range(8):  # alice fills the CPU tier, a block per chain
            plan = alice.post("/v1/store", json={"namespace": ns, "tokens": [i]}).json()
            assert alice.put(f"/v1/blocks/{plan['missing'][0]}", content=b"a" * mib).is_success
        answers = []
        for i in range(8):  # and tries to pin all of it for an hour
            r = alice.post(
                "/v1/lookup", json={"namespace": ns, "tokens": [i], "lease_ms": 3_600_000}
            )
            answers.append(r.status_code)
        assert answers.count(200) <= 5 and answers[-1] == 429, answers  # half, plus one lease
        refused = alice.post("/v1/lookup", json={"namespace": ns, "tokens": [7], "lease_ms": 1000})
        assert "pin_share" in refused.json()["detail"]
        plan = bob.post("/v1/store", json={"namespace": ns, "tokens": [100, 101, 102]}).json()
        statuses = [
            bob.put(f"/v1/blocks/{h}", content=b"b" * mib).status_code for h in plan["missing"]
        ]
        assert statuses == [200, 200, 200], statuses  # room evicted from alice's unpinned
        held = bob.post("/v1/lookup", json={"namespace": ns, "tokens": [100, 101, 102]})
        assert held.json()["matched_blocks"] == 3
        assert (
            'sessioncache_tenant_held{bound="pin_share",tenant="alice"}'
            in bob.get("/metrics", headers=METRICS).text
        )


def test_same_host_staging_counts_with_the_tenants_pins(guarded_node: NodeFactory) -> None:
    mib = 1 << 20
    node = guarded_node(
        {
            "SESSIONCACHE_CPU_BYTES": str(8 * mib),
            "SESSIONCACHE_DISK_BYTES": "0",
            "SESSIONCACHE_CPU_SPARE_CHUNKS": "0",
        }
    )
    lease = {"namespace": NS, "tokens": [1], "lease_ms": 60_000}
    for key in (ALICE, BOB):  # a block each to lease
        with client(node, key) as c:
            plan = c.post("/v1/store", json={"namespace": NS, "tokens": [1]}).json()
            assert c.put(f"/v1/blocks/{plan['missing'][0]}", content=b"x" * mib).is_success
    with (
        SameHostClient.discover(node.url, api_key="key-alice") as alice,
        client(node, ALICE) as rest,
    ):
        root = alice.resolve(Namespace("bounds", 1, "u8", "staging"))
        head = frames.StoreHead(root, None, 1, 5, mib)
        tokens = struct.pack("<5I", *range(5))
        body = alice._c.call(Op.STAGE, lambda rid: frames.encode_stage(rid, head, tokens))
        staged = frames.decode_stage_ok(body, mib)
        # 4 MiB of slots (her share of 8 MiB), never committed; the fifth past it
        assert staged.status == [BlockStatus.STORED] * 4 + [BlockStatus.DROPPED]
        refused = rest.post("/v1/lookup", json=lease)
        assert refused.status_code == 429 and "pin_share" in refused.json()["detail"]
        _abort(alice._c, staged.staging)
        assert rest.post("/v1/lookup", json=lease).json()["matched_blocks"] == 1
    with client(node, BOB) as bob:  # bob's pins were never alice's
        assert bob.post("/v1/lookup", json=lease).json()["matched_blocks"] == 1


def test_pinned_blocks_of_many_sizes_do_not_squat_the_tier(guarded_node: NodeFactory) -> None:
    mib = 1 << 20
    node = guarded_node(
        {
            "SESSIONCACHE_CPU_BYTES": str(256 * mib),  # four 64 MiB slab chunks
            "SESSIONCACHE_DISK_BYTES": "0",
            "SESSIONCACHE_CPU_SPARE_CHUNKS": "0",
        }
    )
    with client(node, ALICE) as alice, client(node, BOB) as bob:
        for i in range(4):  # one small block of its own size per namespace, leased for an hour
            ns = {**NS, "kv_layout": f"squat-{i}"}
            plan = alice.post("/v1/store", json={"namespace": ns, "tokens": [i]}).json()
            put = alice.put(f"/v1/blocks/{plan['missing'][0]}", content=b"a" * (4096 + i))
            assert put.status_code == 200, put.text
            r = alice.post(
                "/v1/lookup", json={"namespace": ns, "tokens": [i], "lease_ms": 3_600_000}
            )
            assert r.status_code == 200 and r.json()["matched_blocks"] == 1, r.text
        ns = {**NS, "kv_layout": "bob"}
        plan = bob.post("/v1/store", json={"namespace": ns, "tokens": [1, 2, 3]}).json()
        statuses = [
            bob.put(f"/v1/blocks/{h}", content=bytes([k]) * mib).status_code
            for k, h in enumerate(plan["missing"])
        ]
        assert statuses == [200, 200, 200], statuses  # alice's 16 KiB hold no 256 MiB
        held = bob.post("/v1/lookup", json={"namespace": ns, "tokens": [1, 2, 3]}).json()
        assert held["matched_blocks"] == 3
