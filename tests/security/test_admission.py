"""Admission before grant: a lease or a session pin is sized before it is made, and a tenant
pins at most its share of each tier, whatever carrier asks and however long."""

from __future__ import annotations

import re

import httpx

from sessioncache.connector import SameHostClient, StreamClient
from sessioncache.dataplane import frames
from sessioncache.hashing import Namespace
from tests.security.conftest import ALICE, BOB, Guarded, NodeFactory, client, wait_until

MIB = 1 << 20
NS = {"model": "admission", "block_tokens": 1, "kv_dtype": "u8", "kv_layout": "x"}
TIERS = {
    "SESSIONCACHE_CPU_BYTES": str(32 * MIB),
    "SESSIONCACHE_DISK_BYTES": str(64 * MIB),
    "SESSIONCACHE_CPU_SPARE_CHUNKS": "0",
}


def tier_figures(c: httpx.Client, name: str) -> dict[str, float]:
    """A node-wide per-tier series of ``/metrics``, by tier."""
    text = c.get("/metrics").text
    return {
        tier: float(value)
        for tier, value in re.findall(rf'sessioncache_tier_{name}\{{tier="(\w+)"\}} (\S+)', text)
    }


def pinned_share(c: httpx.Client) -> float:
    """The largest share of a tier that pins hold (in these tests, bob's: alice leases
    nothing, and nothing is in flight)."""
    pinned, capacity = tier_figures(c, "pinned_bytes"), tier_figures(c, "capacity_bytes")
    return max(pinned[tier] / capacity[tier] for tier in pinned)


def written_behind(c: httpx.Client, blocks: int, pinned: float = 0.0) -> bool:
    """Whether the disk holds ``blocks`` blocks and pins hold ``pinned`` of a tier at most
    (the write-behind queue has copied everything stored: nothing is in flight)."""
    return tier_figures(c, "blocks")["disk"] >= blocks and pinned_share(c) <= pinned


def store(
    c: httpx.Client,
    tokens: list[int],
    fill: int,
    nbytes: int = MIB,
    *,
    ns: dict[str, object] = NS,
    **session: str,
) -> list[int]:
    """Store ``tokens`` (a block each): the status of each block's PUT."""
    plan = c.post("/v1/store", json={"namespace": ns, "tokens": tokens, **session})
    assert plan.status_code == 200, plan.text
    return [
        c.put(f"/v1/blocks/{h}", content=bytes([fill]) * nbytes).status_code
        for h in plan.json()["missing"]
    ]


def alice_stores_twenty(node: Guarded) -> None:
    """Alice's 20 new blocks are all taken and all readable."""
    ns = {**NS, "kv_layout": "alice"}
    with client(node, ALICE) as alice:
        statuses = store(alice, list(range(20)), 7, ns=ns)
        assert statuses == [200] * 20, statuses
        found = alice.post("/v1/lookup", json={"namespace": ns, "tokens": list(range(20))})
        assert found.json()["matched_blocks"] == 20, found.text
        for block in found.json()["blocks"]:
            assert alice.get(f"/v1/blocks/{block['hash']}").content == bytes([7]) * MIB


def test_one_long_lease_pins_at_most_the_tenants_share(guarded_node: NodeFactory) -> None:
    node = guarded_node(TIERS)
    everything = {"namespace": NS, "tokens": list(range(60))}
    with client(node, BOB) as bob:
        assert store(bob, list(range(60)), 1) == [200] * 60
        assert wait_until(lambda: written_behind(bob, 60), 10)
        leased = bob.post("/v1/lookup", json={**everything, "lease_ms": 3_600_000})
        assert leased.status_code == 200, leased.text
        share = pinned_share(bob)
        assert share <= 0.5, share
    alice_stores_twenty(node)
    with client(node, BOB) as bob:
        answer = leased.json()
        assert 0 < answer["matched_blocks"] < 60 and answer["lease_cut"] == "pin_share", answer
        assert wait_until(lambda: pinned_share(bob) <= 0.5, 10)  # alice's moves done
        again = bob.post("/v1/lookup", json={**everything, "lease_ms": 1000})  # pinned already
        assert again.status_code == 200, again.text
        assert again.json()["matched_blocks"] >= answer["matched_blocks"]


def test_a_stream_load_by_ids_pins_at_most_the_tenants_share(guarded_node: NodeFactory) -> None:
    node = guarded_node(TIERS)
    with StreamClient.discover(node.url, api_key="key-bob", timeout=30) as bob:
        root = bob.resolve(Namespace("admission", 1, "u8", "stream"))
        tokens = list(range(60))
        ack = bob.store(root, tokens, [bytes([2]) * MIB for _ in tokens])
        assert ack.kept == 60
        with client(node, BOB) as rest:
            assert wait_until(lambda: written_behind(rest, 60), 10)
        ids = bob.block_hashes(root, tokens)
        # a LOAD of everything, whose answers bob never reads: its lease lasts until the
        # node gives up sending
        rid = bob._c.next_rid()
        bob._c.send(frames.encode_load(rid, frames.LoadIds(list(ids), False, None)))
        with client(node, BOB) as rest:
            assert wait_until(lambda: pinned_share(rest) > 0, 10)
            share = pinned_share(rest)
            assert share <= 0.5, share
        with StreamClient.discover(node.url, api_key="key-bob", timeout=30) as again:
            again.resolve(Namespace("admission", 1, "u8", "stream"))
            found = again.lookup(root, ids, lease_ms=3_600_000)  # the shorter match says so
            assert 0 < found.matched < 60 and found.lease is not None
        alice_stores_twenty(node)
        with client(node, BOB) as rest:
            assert wait_until(lambda: pinned_share(rest) <= 0.5, 10)


def test_a_same_host_locate_pins_at_most_the_tenants_share(guarded_node: NodeFactory) -> None:
    node = guarded_node(
        {
            "SESSIONCACHE_CPU_BYTES": str(8 * MIB),
            "SESSIONCACHE_DISK_BYTES": "0",
            "SESSIONCACHE_CPU_SPARE_CHUNKS": "0",
        }
    )
    with SameHostClient.discover(node.url, api_key="key-alice", timeout=30) as alice:
        root = alice.resolve(Namespace("admission", 1, "u8", "locate"))
        tokens, payloads = list(range(8)), [bytes([3]) * MIB] * 4
        ids = alice.block_hashes(root, tokens)
        assert alice.store(root, tokens[:4], payloads).kept == 4  # a staging: half the tier
        assert alice.store(root, tokens[4:], payloads, parent=ids[3]).kept == 4
        found = alice.locate(root, ids, lease_ms=3_600_000)
        with client(node, BOB) as bob:
            share = pinned_share(bob)
            assert 0 < found.located < 8 and share <= 0.5, (found.located, share)
            statuses = store(bob, [0, 1, 2, 3], 4, ns={**NS, "kv_layout": "bob"})
            assert statuses == [200] * 4, statuses


def test_a_finish_reason_trick_does_not_take_another_tenants_session_pins(
    guarded_node: NodeFactory,
) -> None:
    env = {
        "SESSIONCACHE_CPU_BYTES": str(32 * MIB),
        "SESSIONCACHE_DISK_BYTES": "0",
        "SESSIONCACHE_CPU_SPARE_CHUNKS": "0",
        "SESSIONCACHE_TENANT_PIN_SHARE": "0.25",
    }
    alone = alice_hit_rate(guarded_node(env), tricked=False)
    tricked = alice_hit_rate(guarded_node(env), tricked=True)
    assert alone == 1.0
    assert tricked >= 0.9 * alone, (alone, tricked)


def alice_hit_rate(node: Guarded, *, tricked: bool, turns: int = 6) -> float:
    """Alice's share of her session's prompt found, over ``turns`` turns of a conversation
    that ends each turn with ``stop``; with ``tricked``, bob's 8 sessions, each ending every
    turn with ``tool_use``, store 8 MiB between two of hers."""
    half = MIB // 2
    ns = {**NS, "kv_layout": "sessions"}
    hit = asked = 0
    with client(node, ALICE) as alice, client(node, BOB) as bob:
        assert alice.post("/v1/sessions", json={"session_id": "a"}).status_code == 201
        for s in range(8):
            assert bob.post("/v1/sessions", json={"session_id": f"b{s}"}).status_code == 201
        for turn in range(1, turns + 1):
            prompt = [1000 + t for t in range(turn)]
            if turn > 1:
                found = alice.post(
                    "/v1/lookup", json={"namespace": ns, "tokens": prompt, "session_id": "a"}
                ).json()
                hit += found["matched_blocks"]
                asked += turn
            store(
                alice, [*prompt, 1000 + turn], 1, half, ns=ns, session_id="a", finish_reason="stop"
            )
            if not tricked:
                continue
            for s in range(8):
                chain = [s * 100 + t for t in range(2 * turn)]
                store(bob, chain, 2, half, ns=ns, session_id=f"b{s}", finish_reason="tool_use")
    return hit / asked
