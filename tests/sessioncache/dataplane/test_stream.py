"""Store and load through a real node's block stream: bytes exact in every kind of buffer,
leases that end when they should, refusals that leave the connection usable, and concurrent
writers and readers of the same blocks that never see a torn block."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import numpy as np
import pytest
import torch

from sessioncache.connector import AsyncSessionCacheClient, SessionCacheClient, StreamClient
from sessioncache.connector.errors import IdMismatch
from sessioncache.errors import InvalidInput, LeaseNotFound, PayloadSizeError, StoreRefused
from sessioncache.hashing import Namespace, block_hashes
from tests.sessioncache.dataplane.conftest import (
    BLOCK,
    NS,
    connect,
    pattern,
    rest,
    settled,
    tokens,
    wait_until,
)
from tests.support.servers import Server


def test_discovery(open_server: Server):
    body = rest(open_server, "/v1/dataplane")
    host, _, port = body["stream"].rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0
    with (
        SessionCacheClient(open_server.url, namespace=NS) as rest_client,
        rest_client.stream() as client,
    ):
        assert client.tenant == "default" and client.auth is False
        assert rest(open_server, "/v1/dataplane")["connections"] == 1
    wait_until(lambda: settled(open_server))

    async def from_async() -> str:
        async with AsyncSessionCacheClient(open_server.url, namespace=NS) as rest_client:
            with await rest_client.stream() as client:
                return client.tenant

    assert asyncio.run(from_async()) == "default"
    wait_until(lambda: settled(open_server))


def test_store_then_load_many_blocks_byte_exact(open_server: Server):
    toks = tokens(1, 96)
    with connect(open_server) as client:
        root = client.resolve(NS)
        assert root == NS.root()
        ids = client.block_hashes(root, toks)
        assert ids == block_hashes(NS, toks)
        payloads = [np.random.default_rng(i).integers(0, 256, BLOCK, np.uint8) for i in range(96)]
        ack = client.store(root, toks, payloads, durable=True)  # answered once on disk
        assert ack.hashes == ids and ack.status == ["stored"] * 96 and ack.durable
        assert client.store(root, toks, payloads).status == ["present"] * 96

        found = client.lookup(root, ids, lease_ms=30_000)
        assert found.matched == 96 and found.nbytes == [BLOCK] * 96 and found.lease is not None
        assert set(found.tiers) <= {"cpu", "disk"}
        assert rest(open_server, "/v1/stats")["leases"] == 1
        arrays = np.zeros((32, BLOCK), np.uint8)
        tensors = [torch.zeros(BLOCK // 2, dtype=torch.bfloat16) for _ in range(32)]
        views = [memoryview(bytearray(BLOCK)) for _ in range(32)]
        assert client.load_into(found, list(arrays)) == [True] * 32
        assert client.load_into(found, tensors, start=32) == [True] * 32
        assert client.load_into(found, views, start=64, release=True) == [True] * 32
        assert rest(open_server, "/v1/stats")["leases"] == 0
        for i in range(32):
            assert np.array_equal(arrays[i], payloads[i])
            assert tensors[i].view(torch.uint8).numpy().tobytes() == payloads[32 + i].tobytes()
            assert views[i] == payloads[64 + i].tobytes()
        with pytest.raises(LeaseNotFound):
            client.load_into(found, list(arrays))  # released with the load above

        # by ids, without a lease: the held prefix, then misses
        missing = client.block_hashes(root, tokens(999, 2))
        got = client.load([*ids[:3], *missing])
        assert got[:3] == [payloads[i].tobytes() for i in range(3)] and got[3:] == [None, None]
    wait_until(lambda: settled(open_server))


def test_lookup_is_a_prefix_and_a_store_continues_a_chain(open_server: Server):
    toks = tokens(2, 12)
    with connect(open_server) as client:
        root = client.resolve(NS)
        ids = client.block_hashes(root, toks)
        first = [pattern(h) for h in ids[:5]]
        assert client.store(root, toks[: 5 * 4], first).stored == 5
        found = client.lookup(root, ids)
        assert found.matched == 5 and found.lease is None
        rest_ids = client.block_hashes(root, toks[5 * 4 :], parent=ids[4])
        assert rest_ids == ids[5:]
        ack = client.store(root, toks[5 * 4 :], [pattern(h) for h in ids[5:]], parent=ids[4])
        assert ack.hashes == ids[5:] and ack.stored == 7
        found = client.lookup(root, ids, lease_ms=10_000)
        assert found.matched == 12
        out = [np.empty(BLOCK, np.uint8) for _ in range(12)]
        client.load_into(found, out)
        assert all(np.array_equal(o, pattern(h)) for o, h in zip(out, ids, strict=True))
        client.release(found)
        with pytest.raises(LeaseNotFound):
            client.release(found)
    wait_until(lambda: settled(open_server))


def test_refusals_keep_the_connection_usable(open_server: Server):
    toks = tokens(3, 4)
    with connect(open_server) as client:
        root = client.resolve(NS)
        ids = client.block_hashes(root, toks)
        payloads = [pattern(h) for h in ids]
        stranger = Namespace("never-resolved", 4, "bf16", "x").root()
        with pytest.raises(StoreRefused, match="not resolved"):
            client._namespaces[stranger] = NS  # the client's check out of the way
            client.store(stranger, toks, payloads)
        with pytest.raises(StoreRefused, match="is not held"):
            client.store(root, toks, payloads, parent=b"\x07" * 16)
        assert client.store(root, toks[:4], payloads[:1]).stored == 1
        with pytest.raises(PayloadSizeError, match="this namespace are"):
            client.store(root, toks[4:8], [np.zeros(BLOCK // 2, np.uint8)], parent=ids[0])
        # refused from the STORE's head, before any payload is read
        with pytest.raises(PayloadSizeError, match="this namespace are"):
            client.store(root, toks[4:], [np.zeros(BLOCK // 2, np.uint8)] * 3, parent=ids[0])
        with pytest.raises(InvalidInput, match="lease_s must be in"):
            client.lookup(root, ids, lease_ms=10**9)
        with pytest.raises(LeaseNotFound):
            client.release(b"\x01" * 16)
        # ... and it still answers
        assert client.store(root, toks[4:], payloads[1:], parent=ids[0]).stored == 3
        assert client.lookup(root, ids).matched == 4
    wait_until(lambda: settled(open_server))


def test_a_load_does_not_outlive_its_lease(open_server: Server):
    toks = tokens(4, 3)
    with connect(open_server) as client:
        root = client.resolve(NS)
        ids = client.block_hashes(root, toks)
        client.store(root, toks, [pattern(h) for h in ids])
        found = client.lookup(root, ids, lease_ms=50)
        time.sleep(0.2)
        with pytest.raises(LeaseNotFound):
            client.load_into(found, [np.empty(BLOCK, np.uint8) for _ in ids])
        assert client.lookup(root, ids).matched == 3
    wait_until(lambda: settled(open_server))


def test_the_client_checks_the_nodes_ids(open_server: Server):
    with connect(open_server) as plain:
        plain.resolve(NS)
    client = StreamClient.connect(rest(open_server, "/v1/dataplane")["stream"], seed=7)
    with client, pytest.raises(IdMismatch, match="hash seed"):
        client.resolve(NS)


def test_concurrent_stores_and_loads_of_the_same_blocks_are_never_torn(open_server: Server):
    """Writers store the same chains (same ids, same bytes) and fresh ones that push blocks
    out of the node's 64 MiB CPU tier, while readers lease and load: every block read equals
    its pattern, so none was torn or overwritten while it was sent."""
    ns = Namespace("stream-churn-model", 4, "bf16", "x")
    size = 256 << 10
    chains = [tokens(100 + c, 24) for c in range(3)]
    errors: list[BaseException] = []
    stop = threading.Event()
    loads = [0]
    before = rest(open_server, "/v1/stats")["counters"]

    def writer(seed: int) -> None:
        with connect(open_server) as client:
            root = client.resolve(ns)
            for r in range(6):
                for toks in [*chains, tokens(seed * 1000 + r, 24)]:
                    ids = client.block_hashes(root, toks)
                    client.store(root, toks, [pattern(h, size) for h in ids])

    def reader() -> None:
        with connect(open_server) as client:
            root = client.resolve(ns)
            out = [np.empty(size, np.uint8) for _ in range(24)]
            while not stop.is_set():
                for toks in chains:
                    ids = client.block_hashes(root, toks)
                    found = client.lookup(root, ids, lease_ms=10_000)
                    n = found.matched
                    if n:
                        client.load_into(found, out[:n], release=True)
                        for h, o in zip(ids[:n], out[:n], strict=True):
                            assert np.array_equal(o, pattern(h, size)), "a torn or foreign block"
                        loads[0] += n

    def guarded(fn: object, *args: object) -> None:
        try:
            fn(*args)  # type: ignore[operator]
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    writers = [threading.Thread(target=guarded, args=(writer, s)) for s in (1, 2)]
    readers = [threading.Thread(target=guarded, args=(reader,)) for _ in range(2)]
    for t in [*writers, *readers]:
        t.start()
    for t in writers:
        t.join(120)
    stop.set()
    for t in readers:
        t.join(60)
    assert not errors, errors
    assert loads[0] > 0
    after = rest(open_server, "/v1/stats")["counters"]
    assert after["evictions"] > before["evictions"]  # slots were reused meanwhile
    wait_until(lambda: settled(open_server))


def test_rest_sees_what_the_stream_stored(open_server: Server):
    toks = tokens(5, 2)
    with connect(open_server) as client:
        root = client.resolve(NS)
        ids = client.block_hashes(root, toks)
        client.store(root, toks, [pattern(h) for h in ids])
    body = httpx.post(
        f"{open_server.url}/v1/lookup",
        json={"namespace": {"model": NS.model, "block_tokens": 4, "kv_dtype": "bf16",
                            "kv_layout": "x"}, "tokens": toks.tolist()},
    ).json()  # fmt: skip
    assert body["matched_blocks"] == 2
    assert httpx.get(f"{open_server.url}/v1/blocks/{ids[1].hex()}").content == bytes(
        pattern(ids[1])
    )
