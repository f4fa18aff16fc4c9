"""Every 2xx means held: a block the node cannot place gets a 507, and a child is never
stored while its parent is not held (in chain order, out of order, and across tenants)."""

from __future__ import annotations

import httpx

from tests.security.conftest import ALICE, BOB, NodeFactory, client

NS = {"model": "held", "block_tokens": 1, "kv_dtype": "bf16", "kv_layout": "x"}
MiB = 1 << 20
DISK_ONLY = {
    "SESSIONCACHE_CPU_BYTES": "0",
    "SESSIONCACHE_DISK_BYTES": str(8 * MiB),
    "SESSIONCACHE_MAX_BODY_BYTES": str(2 * MiB),
}


def plan(c: httpx.Client, tokens: list[int]) -> list[str]:
    r = c.post("/v1/store", json={"namespace": NS, "tokens": tokens})
    assert r.status_code == 200, r.text
    return list(r.json()["missing"])


def matched(c: httpx.Client, tokens: list[int]) -> int:
    r = c.post("/v1/lookup", json={"namespace": NS, "tokens": tokens})
    assert r.status_code == 200, r.text
    return int(r.json()["matched_blocks"])


def upload(c: httpx.Client, h: str, fill: int) -> httpx.Response:
    return c.put(f"/v1/blocks/{h}", content=bytes([fill]) * MiB)


def test_a_put_the_node_cannot_keep_is_507_and_so_is_every_later_block(
    guarded_node: NodeFactory,
) -> None:
    node = guarded_node(DISK_ONLY)
    tokens = list(range(12))
    with client(node, ALICE) as c:
        answers = [upload(c, h, i).status_code for i, h in enumerate(plan(c, tokens))]
        ok = answers.count(200)
        assert 0 < ok < 12 and answers == [200] * ok + [507] * (12 - ok), answers
        assert matched(c, tokens) == ok  # every 200 is held, the chain whole up to there


def test_a_child_uploaded_before_its_parent_is_not_stored(guarded_node: NodeFactory) -> None:
    node = guarded_node(DISK_ONLY)
    tokens = list(range(4))
    with client(node, ALICE) as c:
        ids = plan(c, tokens)
        r = upload(c, ids[1], 1)
        assert r.status_code == 507 and "parent" in r.json()["detail"], r.text
        assert [upload(c, h, i).status_code for i, h in enumerate(ids)] == [200] * 4
        assert matched(c, tokens) == 4


def test_one_tenant_pinning_the_tiers_makes_the_others_stores_507_not_200(
    guarded_node: NodeFactory,
) -> None:
    node = guarded_node({**DISK_ONLY, "SESSIONCACHE_TENANT_PIN_SHARE": "1"})  # all hers
    mine, theirs = list(range(6)), list(range(100, 106))
    with client(node, ALICE) as alice, client(node, BOB) as bob:
        assert [upload(alice, h, i).status_code for i, h in enumerate(plan(alice, mine))] == [
            200
        ] * 6
        lease = alice.post(
            "/v1/lookup", json={"namespace": NS, "tokens": mine, "lease_ms": 3_600_000}
        )
        assert lease.json()["matched_blocks"] == 6
        answers = [upload(bob, h, i).status_code for i, h in enumerate(plan(bob, theirs))]
        ok = answers.count(200)
        assert answers == [200] * ok + [507] * (6 - ok), answers
        assert matched(bob, theirs) == ok
        assert matched(alice, mine) == 6  # nothing of hers was evicted for bob
