"""KVTransfer's keyed operations (blocks named by 16-byte keys, as LMCache and SGLang name KV)
against a real node, on the stream and the same-host path: store, exists, the held prefix and
loads into the caller's buffers, requests of a few ids at most (each batch here takes several),
a miss in the middle (the same-host path locates again past it), parents that continue a
chain, two tenants that never read each other's blocks, and the REST path refusing them."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from sessioncache.connector import SessionCacheClient, ops
from sessioncache.connector.samehost import SameHostClient, SameHostLookup
from sessioncache.connector.transfer import DATA_PLANE_PATHS, KVTransfer
from sessioncache.dataplane.frames import Limits
from sessioncache.errors import InvalidInput, TransportError
from sessioncache.hashing import Namespace, block_key
from sessioncache.status import BlockStatus
from tests.support.servers import Server, start_server

BLOCK = 4096
MAX_IDS = 4
KEYS = {"key-a": "ta", "key-b": "tb"}
PATHS = ["same_host", "stream"]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("transfer-keyed") / "data",
        {
            "SESSIONCACHE_API_KEYS": json.dumps(KEYS),
            "SESSIONCACHE_SHM_TRUSTED_TENANTS": json.dumps(sorted(KEYS.values())),
            "SESSIONCACHE_STREAM_MAX_IDS": str(MAX_IDS),
        },
    )
    yield server
    server.stop()


def transfer(node: Server, path: str, api_key: str = "key-a") -> KVTransfer:
    kv = KVTransfer.from_url(node.url, api_key=api_key, path=path, paths=DATA_PLANE_PATHS)  # type: ignore[arg-type]
    assert kv.path == path
    return kv


def namespace(model: str) -> Namespace:
    return Namespace(model, 1, "raw", "keyed-test")


def keys_for(tag: str, n: int) -> list[bytes]:
    return [block_key(f"{tag}-{i}") for i in range(n)]


def payloads(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(n)]


def buffers(n: int) -> list[np.ndarray]:
    return [np.zeros(BLOCK, dtype=np.uint8) for _ in range(n)]


def hit_tokens(server: Server) -> int:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    found = re.search(r"^sessioncache_hit_tokens_total (\S+)$", text, re.M)
    assert found is not None, "no sessioncache_hit_tokens_total in /metrics"
    return int(float(found.group(1)))


@pytest.mark.parametrize("path", PATHS)
def test_keyed_blocks_round_trip(node: Server, path: str):
    ns, keys, blocks = namespace(f"round-{path}"), keys_for(f"round-{path}", 10), payloads(1, 10)
    with transfer(node, path) as kv:
        assert kv.exists_keyed(ns, keys) == [False] * 10
        assert kv.held_prefix_keyed(ns, keys) == 0
        out = buffers(10)
        assert kv.load_keyed(ns, keys, out) == [False] * 10
        assert not any(o.any() for o in out)

        ack = kv.store_keyed(ns, keys, blocks)  # 10 blocks, requests of 4 at most
        assert ack.held == [True] * 10 and ack.kept == 10 and ack.stored == 10
        assert ack.hashes == kv.key_ids(ns, keys) == kv.key_ids(kv.root(ns), keys)
        assert kv.exists_keyed(ns, keys) == [True] * 10
        assert kv.held_prefix_keyed(ns, keys) == 10

        assert kv.load_keyed(ns, keys, out) == [True] * 10
        for got, want in zip(out, blocks, strict=True):
            assert np.array_equal(got, want)
        # stored again: held already, nothing rewritten
        again = kv.store_keyed(ns, keys, payloads(2, 10))
        assert again.status == [BlockStatus.PRESENT] * 10
        with pytest.raises(InvalidInput):
            kv.load_keyed(ns, keys, out[:3])
        with pytest.raises(InvalidInput):
            kv.store_keyed(ns, keys, blocks[:3])


@pytest.mark.parametrize("path", PATHS)
def test_a_miss_in_the_middle(node: Server, path: str, monkeypatch: pytest.MonkeyPatch):
    ns, keys, blocks = namespace(f"miss-{path}"), keys_for(f"miss-{path}", 10), payloads(3, 10)
    absent = {1, 6}
    located: list[int] = []
    copied_from: list[type] = []
    real_locate, real_load = SameHostClient.locate, SameHostClient.load_into

    def locate(self: SameHostClient, root: bytes, ids: Any, **kw: Any) -> Any:
        located.append(len(ids))
        return real_locate(self, root, ids, **kw)

    def load_into(self: SameHostClient, source: Any, out: Any, **kw: Any) -> Any:
        copied_from.append(type(source))
        return real_load(self, source, out, **kw)

    monkeypatch.setattr(SameHostClient, "locate", locate)
    monkeypatch.setattr(SameHostClient, "load_into", load_into)
    with transfer(node, path) as kv:
        held = [i for i in range(10) if i not in absent]
        kv.store_keyed(ns, [keys[i] for i in held], [blocks[i] for i in held], linked=False)
        want = [i not in absent for i in range(10)]
        assert kv.exists_keyed(ns, keys) == want
        assert kv.held_prefix_keyed(ns, keys) == 1

        located.clear()
        out = buffers(10)
        assert kv.load_keyed(ns, keys, out) == want
        for i in range(10):
            assert np.array_equal(out[i], blocks[i] if want[i] else np.zeros(BLOCK, np.uint8))
        if path == "same_host":
            # the held run from key 0, then again past each miss, 4 ids a request at most;
            # every block copied out of shared memory
            assert located == [4, 4, 4, 3]
            assert set(copied_from) == {SameHostLookup}
        else:
            assert located == []

        # SGLang's reads: the run held from the first key only, nothing asked past the miss
        located.clear()
        out = buffers(10)
        assert kv.load_keyed(ns, keys, out, prefix=True) == [True] + [False] * 9
        assert np.array_equal(out[0], blocks[0])
        assert not any(o.any() for o in out[MAX_IDS:])  # the next requests were never sent
        if path == "same_host":
            assert located == [4] and not any(o.any() for o in out[1:])


@pytest.mark.parametrize("path", PATHS)
def test_loads_count_only_when_asked(node: Server, path: str):
    ns, keys = namespace(f"count-{path}"), keys_for(f"count-{path}", 6)
    with transfer(node, path) as kv:
        kv.store_keyed(ns, keys[:4], payloads(4, 4))
        out = buffers(6)
        before = hit_tokens(node)
        assert kv.load_keyed(ns, keys, out) == [True] * 4 + [False] * 2
        assert kv.exists_keyed(ns, keys, counted=False) == [True] * 4 + [False] * 2
        assert hit_tokens(node) == before  # a fetch and a probe: not the prompt's question
        assert kv.exists_keyed(ns, keys) == [True] * 4 + [False] * 2
        assert hit_tokens(node) == before + 4  # blocks of one token each
        assert kv.load_keyed(ns, keys, out, counted=True) == [True] * 4 + [False] * 2
        assert hit_tokens(node) == before + 8


@pytest.mark.parametrize("path", PATHS)
def test_a_batch_continues_the_chain_of_a_held_parent(node: Server, path: str):
    ns = namespace(f"chain-{path}")
    with (
        transfer(node, path) as kv,
        SessionCacheClient(node.url, namespace=ns, api_key="key-a") as rest,
        rest.stream() as stream,
    ):
        root = stream.resolve(ns)
        for tag, parent_key, chained in (
            ("held", None, 6),  # parent: the first batch's last block
            ("gone", block_key("never-stored"), 3),  # no such parent: a chain of its own
        ):
            keys = keys_for(f"chain-{path}-{tag}", 6)
            kv.store_keyed(ns, keys[:3], payloads(5, 3))
            after = keys[2] if parent_key is None else parent_key
            assert kv.store_keyed(ns, keys[3:], payloads(6, 3), parent_key=after).kept == 3
            ids = stream.key_ids(root, keys)[:MAX_IDS]
            # a chain LOOKUP from the first block: the blocks linked to it, parents first
            assert stream.lookup(root, ids).matched == min(chained, MAX_IDS)


@pytest.mark.parametrize("path", PATHS)
def test_blocks_said_held_are_neither_read_nor_sent(node: Server, path: str):
    """``held`` blocks are answered present without their payloads (None here), the linked
    runs after them hang off them; one said held but not (a stale check) leaves the next run
    a chain of its own."""
    ns = namespace(f"held-{path}")
    with (
        transfer(node, path) as kv,
        SessionCacheClient(node.url, namespace=ns, api_key="key-a") as rest,
        rest.stream() as stream,
    ):
        root = stream.resolve(ns)
        keys = keys_for(f"held-{path}", 4)
        data = payloads(7, 4)
        assert kv.store_keyed(ns, keys[:2], data[:2]).kept == 2
        held = kv.exists_keyed(ns, keys, counted=False)
        assert held == [True, True, False, False]
        ack = kv.store_keyed(ns, keys, [None, None, *data[2:]], held=held)
        assert ack.status == [BlockStatus.PRESENT] * 2 + [BlockStatus.STORED] * 2
        assert ack.hashes == stream.key_ids(root, keys)
        assert stream.lookup(root, ack.hashes).matched == 4  # one chain
        out = buffers(4)
        assert kv.load_keyed(ns, keys, out) == [True] * 4
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))

        stale = keys_for(f"held-stale-{path}", 3)
        ack = kv.store_keyed(ns, stale, [None, *payloads(8, 2)], held=[True, False, False])
        assert ack.status[1:] == [BlockStatus.STORED] * 2
        assert kv.exists_keyed(ns, stale, counted=False) == [False, True, True]
        with pytest.raises(InvalidInput, match="held flags"):
            kv.store_keyed(ns, stale, payloads(8, 3), held=[True])


@pytest.mark.parametrize("path", PATHS)
def test_a_tenant_cannot_read_anothers_keyed_blocks(node: Server, path: str):
    ns, keys = namespace(f"tenants-{path}"), keys_for(f"tenants-{path}", 5)
    mine, theirs = payloads(7, 5), payloads(8, 5)
    with transfer(node, path, "key-a") as a, transfer(node, path, "key-b") as b:
        assert a.store_keyed(ns, keys, mine).kept == 5
        assert a.key_ids(ns, keys) != b.key_ids(ns, keys)  # roots salted by the tenant
        assert b.exists_keyed(ns, keys) == [False] * 5
        assert b.held_prefix_keyed(ns, keys) == 0
        out = buffers(5)
        assert b.load_keyed(ns, keys, out) == [False] * 5
        assert not any(o.any() for o in out)  # nothing copied in
        # their blocks under the same keys are theirs; mine stay intact
        assert b.store_keyed(ns, keys, theirs).stored == 5
        assert a.load_keyed(ns, keys, out) == [True] * 5
        assert all(np.array_equal(o, m) for o, m in zip(out, mine, strict=True))
        assert b.load_keyed(ns, keys, out) == [True] * 5
        assert all(np.array_equal(o, t) for o, t in zip(out, theirs, strict=True))


def test_a_broken_connection_is_replaced(node: Server):
    ns, keys = namespace("reconnect"), keys_for("reconnect", 3)
    with transfer(node, "stream") as kv:
        kv.store_keyed(ns, keys, payloads(9, 3))
        kv.disconnect()
        assert not kv.connected
        assert kv.exists_keyed(ns, keys) == [True] * 3  # connected again, root resolved again
        assert kv.connected and kv.path == "stream"


def test_the_rest_path_refuses_keyed_operations(node: Server):
    ns, keys = namespace("rest"), keys_for("rest", 2)
    client = SessionCacheClient(node.url, namespace=ns, api_key="key-a")
    with client, KVTransfer(client, path="rest") as kv:
        assert kv.path == "rest"
        for call in (
            lambda: kv.exists_keyed(ns, keys),
            lambda: kv.held_prefix_keyed(ns, keys),
            lambda: kv.load_keyed(ns, keys, buffers(2)),
            lambda: kv.store_keyed(ns, keys, payloads(10, 2)),
            lambda: kv.key_ids(ns, keys),
            lambda: kv.root(ns),
        ):
            with pytest.raises(InvalidInput, match="REST API has no keyed blocks"):
                call()
        with pytest.raises(InvalidInput, match="path must be"):
            KVTransfer(client, path="rest", paths=DATA_PLANE_PATHS)


def test_a_transfer_without_a_namespace_moves_keyed_blocks_only(node: Server):
    with transfer(node, "stream") as kv, pytest.raises(InvalidInput, match="namespace"):
        kv.load_into(list(range(16)), buffers(1))


class ColdSameHost(SameHostClient):
    """A same-host connection (no socket: its calls answered here) to a node holding
    ``held``, of which the ``cold`` blocks cannot be placed in shared memory now: a LOCATE
    leases them past its located run."""

    limits = Limits(max_ids=MAX_IDS)

    def __init__(self, held: set[bytes], cold: set[bytes]) -> None:
        self.held, self.cold = held, cold
        self.over_the_socket: list[list[bytes]] = []

    def locate(self, root: bytes, ids: list[bytes], **kw: Any) -> SameHostLookup:
        run = next((i for i, h in enumerate(ids) if h not in self.held), len(ids))
        placed = next((i for i, h in enumerate(ids[:run]) if h in self.cold), run)
        lease = b"lease" if run else None
        return SameHostLookup(root, list(ids[:placed]), run, [], lease, 0.0)

    def load_into(self, source: Any, out: list[np.ndarray], **kw: Any) -> list[bool]:
        ids = source.hashes if isinstance(source, SameHostLookup) else list(source)
        if not isinstance(source, SameHostLookup):
            self.over_the_socket.append(ids)
        got = []
        for h, o in zip(ids, out, strict=False):
            if h in self.held:
                o[:] = h[0]
            got.append(h in self.held)
        return got + [False] * (len(out) - len(got))

    def release_checked(self, lease: Any) -> bool:
        return True


@pytest.mark.parametrize("prefix", [False, True])
def test_same_host_blocks_not_placeable_go_over_the_socket(prefix: bool):
    ids = [bytes([i]) * 16 for i in range(10)]
    conn = ColdSameHost({h for i, h in enumerate(ids) if i != 6}, {ids[2]})
    out = [np.zeros(4, np.uint8) for _ in ids]
    got = ops.load(
        conn, b"r" * 16, ids, ops.Targets.buffers(out), lease_ms=1000, keyed=True, prefix=prefix
    )
    # 0, 1 from shared memory; 2 (cold) and 3 after it over the socket; 6 is not held
    assert conn.over_the_socket == [ids[2:4]]
    want = [True] * 6 + [False] * 4 if prefix else [i != 6 for i in range(10)]
    assert got == want
    assert [int(o[0]) for o in out] == [i if ok else 0 for i, ok in enumerate(want)]


def test_a_node_without_a_data_plane(tmp_path_factory: pytest.TempPathFactory):
    server = start_server(
        tmp_path_factory.mktemp("transfer-keyed-rest") / "data",
        {"SESSIONCACHE_STREAM_ENABLED": "false", "SESSIONCACHE_SHM": "false"},
    )
    try:
        ns, keys = namespace("rest-only"), keys_for("rest-only", 2)
        with KVTransfer.from_url(server.url) as kv:
            assert kv.path == "rest"  # auto falls back to REST, which has no keyed blocks
            with pytest.raises(InvalidInput, match="REST API has no keyed blocks"):
                kv.exists_keyed(ns, keys)
        with KVTransfer.from_url(server.url, paths=DATA_PLANE_PATHS) as kv:
            with pytest.raises(TransportError, match="no data path") as err:
                kv.exists_keyed(ns, keys)
            assert "same_host" in str(err.value) and "stream" in str(err.value)
            assert not kv.connected
    finally:
        server.stop()
