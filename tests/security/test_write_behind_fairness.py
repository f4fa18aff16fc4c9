"""The write-behind queue serves tenants in turn: bob's flood of write-behind stores, filling
his share of the queue, does not make alice's durable stores wait behind it. What she waited
for is counted in bytes of bob's blocks (``sessioncache_write_behind_durable_waited_bytes``):
the batch under way and a few slots of her own batch, never his backlog, whatever the disk's
speed or the machine's load."""

from __future__ import annotations

import re
import statistics
import threading
import time
from itertools import count

import httpx

from tests.security.conftest import ALICE, BOB, Guarded, NodeFactory, client, wait_until

NS = {"model": "fair-behind", "block_tokens": 16, "kv_dtype": "u8", "kv_layout": "x"}
BLOCK = 64 << 10
BOUND = 64 << 20  # bob's share: half of it, 512 blocks, 8 batches of 64
BATCH = 64 * BLOCK  # the write-behind's batch: 64 blocks
STORES = 15
ADMIN = {"authorization": "Bearer admin-token"}  # reads the per-tenant series of /metrics


def durable_put_s(alice: httpx.Client, seed: int) -> float:
    """Store one block durably (a chain of its own); how long its PUT took."""
    tokens = [seed * 100 + t for t in range(16)]
    (h,) = alice.post("/v1/store", json={"namespace": NS, "tokens": tokens}).json()["missing"]
    started = time.perf_counter()
    r = alice.put(f"/v1/blocks/{h}?durable=true", content=bytes([seed % 256]) * BLOCK)
    took = time.perf_counter() - started
    assert r.status_code == 200 and r.json()["durable"], r.text
    return took


def flood(node: Guarded, seeds: count[int], stop: threading.Event) -> None:
    """Bob's write-behind stores, chains of 32 blocks, until ``stop``."""
    with client(node, BOB) as bob:
        while not stop.is_set():
            seed = next(seeds)
            tokens = [seed * 1000 + t for t in range(32 * 16)]
            plan = bob.post("/v1/store", json={"namespace": NS, "tokens": tokens})
            for h in plan.json()["missing"]:
                if stop.is_set():
                    return
                r = bob.put(f"/v1/blocks/{h}", content=bytes([seed % 256]) * BLOCK)
                assert r.status_code == 200, r.text


def tenant_series(node: Guarded, name: str, tenant: str) -> float:
    metrics = httpx.get(f"{node.url}/metrics", headers=ADMIN).text
    found = re.search(rf'{name}{{tenant="{tenant}"}} (\S+)', metrics)
    return float(found.group(1)) if found else 0.0


def queued(node: Guarded, tenant: str) -> float:
    return tenant_series(node, "sessioncache_write_behind_bytes", tenant)


def waited(node: Guarded, tenant: str) -> float:
    """The most bytes of other tenants' blocks one of ``tenant``'s durable stores waited for."""
    return tenant_series(node, "sessioncache_write_behind_durable_waited_bytes", tenant)


def test_a_durable_store_does_not_wait_behind_another_tenants_write_behind_flood(
    guarded_node: NodeFactory,
) -> None:
    node = guarded_node(
        {
            "SESSIONCACHE_ADMIN_TOKEN": "admin-token",
            "SESSIONCACHE_WRITE_BEHIND_BYTES": str(BOUND),
            "SESSIONCACHE_CPU_BYTES": str(256 << 20),
            "SESSIONCACHE_DISK_BYTES": str(2 << 30),
        }
    )
    ahead: list[float] = []  # bob's backlog as each of alice's crowded stores is sent
    with client(node, ALICE) as alice:
        alone = [durable_put_s(alice, i) for i in range(STORES)]
        assert waited(node, "alice") == 0
        stop = threading.Event()
        seeds = count()
        floods = [threading.Thread(target=flood, args=(node, seeds, stop)) for _ in range(2)]
        for t in floods:
            t.start()
        try:
            assert wait_until(lambda: queued(node, "bob") >= BOUND / 2 * 0.75, 20)
            crowded: list[float] = []
            for i in range(STORES):
                ahead.append(queued(node, "bob"))
                crowded.append(durable_put_s(alice, STORES + i))
            bob_queued = queued(node, "bob")
            most = waited(node, "alice")
        finally:
            stop.set()
            for t in floods:
                t.join(30)
    quiet, busy = statistics.median(alone), statistics.median(crowded)
    print(
        f"alice's durable 64 KiB PUT: median {quiet * 1e3:.1f} ms alone, {busy * 1e3:.1f} ms "
        f"under bob's flood ({busy / quiet:.1f}x; p90 {sorted(crowded)[13] * 1e3:.1f} ms; "
        f"bob's backlog at the end {bob_queued / (1 << 20):.0f} MiB; the most of his an "
        f"acknowledgement of hers waited for {most / (1 << 20):.1f} MiB)"
    )
    # Queued in turn, hers waits for the batch under way (64 blocks) and an eighth of a batch
    # of bob's about hers: not for the backlog of his she found (most of his share).
    assert most <= BATCH + BATCH // 8
    assert statistics.median(ahead) >= 2 * BATCH
