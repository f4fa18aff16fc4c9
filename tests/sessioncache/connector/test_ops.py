"""``connector.ops`` (the one load loop) and ``retry.NodeBackoff`` (the one failure policy)
through each engine-side adapter, against a real node killed in the middle of a load: between
the lookup and the copy (the carrier's load is about to run), or after a paged load's first
chunk. Each load reports a miss or a shorter run (never bytes that are not the block's), or
raises where the adapter's contract is to raise (``KVTransfer``, ``EngineNode``: their callers
recompute); the backoff then applies: the node restarted and holding the blocks again, a call
within it misses at once (had it reached the node it would hit); after it, the call reconnects
and loads."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sessioncache.connector import ops
from sessioncache.connector.lmcache import SessionCacheL2
from sessioncache.connector.paged import EngineNode, NodeSettings, PagedLayout, Scope, Transfer
from sessioncache.connector.retry import REQUEST_ERRORS, NodeBackoff, NodeDown
from sessioncache.connector.samehost import SameHostClient
from sessioncache.connector.stream import StreamClient
from sessioncache.connector.transfer import DATA_PLANE_PATHS, KVTransfer
from sessioncache.errors import SessionCacheError
from sessioncache.hashing import Namespace, block_key
from tests.support.adapters import hicache_config, wait_for
from tests.support.servers import Server, free_port, spawn_server, wait_ready

PATHS = ["same_host", "stream"]
KEYS = {"sk-ops": "ops"}
ENV = {
    "SESSIONCACHE_API_KEYS": json.dumps(KEYS),
    "SESSIONCACHE_SHM_TRUSTED_TENANTS": json.dumps(["ops"]),
    "SESSIONCACHE_STREAM_MAX_IDS": "4",  # keyed loads of several requests
}
NS = Namespace("ops-test", 4, "uint8", "raw")
BLOCK = 4096


class Node:
    """A real node that a test kills, and starts again on its port and data directory."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.port = free_port()
        self.server = self._start()

    def _start(self) -> Server:
        return wait_ready(spawn_server(self.data, ENV, port=self.port))

    @property
    def url(self) -> str:
        return self.server.url

    def kill(self) -> None:
        self.server.process.kill()
        self.server.process.wait(10)

    def restart(self) -> None:
        self.server = self._start()

    def stop(self) -> None:
        self.server.stop()


class Clock:
    """A backoff's clock that the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    node = Node(tmp_path / "data")
    yield node
    node.stop()


@pytest.fixture
def kill_at_load(monkeypatch: pytest.MonkeyPatch, node: Node) -> Callable[[], None]:
    """Arm: the node is killed as the next carrier load starts (the lookup answered, the
    blocks not copied nor sent yet). The carriers are the real ones; only the kill is added."""
    armed: list[bool] = []
    for cls in (StreamClient, SameHostClient):
        original = cls.load_into

        def load_into(self: Any, *args: Any, _original: Any = original, **kw: Any) -> Any:
            if armed:
                armed.clear()
                node.kill()
            return _original(self, *args, **kw)

        monkeypatch.setattr(cls, "load_into", load_into)
    return lambda: armed.append(True)


def tokens(n_blocks: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 30_000, n_blocks * NS.block_tokens)]


def payloads(n: int, seed: int, size: int = BLOCK) -> list[bytes]:
    return [bytes([(seed * 16 + i) % 251 + 1]) * size for i in range(n)]


def store_chain(node: Node, prompt: list[int], blocks: Sequence[bytes]) -> None:
    """The blocks stored by another engine (its own connection)."""
    with KVTransfer.from_url(node.url, api_key="sk-ops", namespace=NS, path="stream") as kv:
        assert kv.store_from(prompt, blocks).blocks == len(blocks)


# -- KVTransfer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_a_transfer_killed_mid_load_raises_then_the_policy_misses_then_reconnects(
    node: Node, kill_at_load: Callable[[], None], path: str
) -> None:
    prompt, blocks = tokens(3, 1), payloads(3, 1)
    store_chain(node, prompt, blocks)
    clock = Clock()
    policy = NodeBackoff(clock=clock)
    kv = KVTransfer.from_url(
        node.url, api_key="sk-ops", namespace=NS, path=path, paths=DATA_PLANE_PATHS, timeout=5
    )
    out = [np.zeros(BLOCK, np.uint8) for _ in blocks]

    def load() -> int:
        return kv.load_into(prompt, out).blocks

    try:
        kill_at_load()
        with pytest.raises(SessionCacheError) as failed:
            policy.guard(load, kv.disconnect)
        assert policy.down and not kv.connected  # the node's failure: disconnected, backing off
        assert all(o.tobytes() in (bytes(BLOCK), b) for o, b in zip(out, blocks, strict=True))
        node.restart()
        store_chain(node, prompt, blocks)
        assert policy.call("load", load, 0) == 0  # within the backoff: at once, no connection
        assert not kv.connected
        with pytest.raises(NodeDown):
            policy.guard(load)
        clock.now += 1.0
        assert policy.call("load", load, 0) == 3
        assert [o.tobytes() for o in out] == blocks
        assert not policy.down and kv.path == path
    finally:
        kv.close()
    assert not isinstance(failed.value, REQUEST_ERRORS)  # the node's failure, not the request's


# -- EngineNode (vLLM's worker side) -------------------------------------------------------------


LAYERS, BLOCKS, HEADS, CONTENT = 2, 12, 2, 16


def paged_cache(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(LAYERS, BLOCKS, HEADS, NS.block_tokens, CONTENT, generator=g).bfloat16()
    return {f"layer.{i}": buf[i] for i in range(LAYERS)}


def engine_block(cache: dict[str, torch.Tensor], block: int) -> bytes:
    return b"".join(
        t[block].contiguous().view(torch.uint8).numpy().tobytes() for t in cache.values()
    )


class KillingLayout:
    """A paged layout whose first ``scatter`` kills the node first: on the same host between
    the LOCATE and the copy, over the stream after the first chunk arrived."""

    def __init__(self, layout: PagedLayout, node: Node) -> None:
        self.layout, self.node = layout, node
        self.nbytes, self.device = layout.nbytes, layout.device
        self.scatters = 0

    def scatter(self, targets: Sequence[Any], sources: Sequence[Any]) -> None:
        if not self.scatters:
            self.node.kill()
        self.scatters += 1
        self.layout.scatter(targets, sources)

    def gather(self, targets: Sequence[Any], out: Sequence[Any]) -> None:
        self.layout.gather(targets, out)


@pytest.mark.parametrize("path", PATHS)
def test_an_engine_node_killed_mid_load(
    node: Node, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    source = paged_cache(1)
    prompt = tokens(4, 2)  # one request's most
    src_blocks = [3, 8, 0, 5]
    blocks = [engine_block(source, b) for b in src_blocks]
    nbytes = len(blocks[0])
    store_chain(node, prompt, blocks)
    # over the stream: chunks of two blocks, the node killed once the first was placed
    monkeypatch.setattr(ops, "STREAM_CHUNK_BYTES", 2 * nbytes)
    clock = Clock()
    engine = EngineNode(NodeSettings(node.url, "sk-ops", path, timeout_s=5), clock=clock)
    cache = paged_cache(2)
    before = [engine_block(cache, b) for b in range(BLOCKS)]
    layout = PagedLayout(cache, BLOCKS)
    killing = KillingLayout(layout, node)
    into = [2, 4, 9, 11]
    scope = Scope()
    transfer = Transfer("r", prompt, 0, into, scope)
    try:
        assert engine.connect(scope) == path
        ids_root = engine.kv(scope).root(NS)
        ids = engine.kv(scope).connection.block_hashes(ids_root, prompt)
        with pytest.raises(SessionCacheError) as failed:
            engine.load_ids(scope, ids_root, ids, 0, into, killing)
        assert engine.failure(failed.value) == 1.0 and engine.down
        # what was placed is the blocks', the rest untouched: never another block's bytes
        for b, want in zip(into, blocks, strict=True):
            assert engine_block(cache, b) in (want, before[b])
        if path == "stream":  # the first chunk arrived whole, nothing after it
            assert [engine_block(cache, b) for b in into[:2]] == blocks[:2]
            assert [engine_block(cache, b) for b in into[2:]] == [before[b] for b in into[2:]]
        node.restart()
        store_chain(node, prompt, blocks)
        with pytest.raises(NodeDown):  # within the backoff a caller gets no connection
            engine.backoff.guard(lambda: engine.load(NS, transfer, layout))
        clock.now += 1.0
        assert not engine.down
        assert engine.load(NS, transfer, layout).blocks == 4
        assert [engine_block(cache, b) for b in into] == blocks
    finally:
        engine.close()
        layout.close()


def test_an_engine_nodes_loads_carry_the_requests_session(node: Node) -> None:
    """The lease of a load names the request's session, as its lookup and save do: the
    session is seen (``last_seen``) at the load too."""
    prompt = tokens(2, 3)
    store_chain(node, prompt, payloads(2, 3, size=LAYERS * HEADS * NS.block_tokens * CONTENT * 2))
    engine = EngineNode(NodeSettings(node.url, "sk-ops", "stream", timeout_s=5))
    layout = PagedLayout(paged_cache(4), BLOCKS)
    scope = Scope(session_id="ops-session")
    try:
        assert engine.held_blocks(NS, prompt, scope) == 2  # opens the session
        client = engine.kv(scope).client
        seen = client.get_session("ops-session").last_seen
        time.sleep(0.05)
        assert engine.load(NS, Transfer("r", prompt, 0, [1, 2], scope), layout).blocks == 2
        assert client.get_session("ops-session").last_seen > seen
        gone = Scope(session_id="never-opened")  # a session the node does not know: a miss
        with pytest.raises(SessionCacheError):
            engine.load(NS, Transfer("r", prompt, 0, [1, 2], gone), layout)
    finally:
        engine.close()
        layout.close()


# -- SGLang's HiCache backend -------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_sglang_misses_while_the_node_is_down_then_reconnects(
    node: Node, kill_at_load: Callable[[], None], path: str
) -> None:
    pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")
    from sessioncache.connector.sglang import SessionCacheHiCacheStorage

    config = hicache_config(
        {"url": node.url, "api_key": "sk-ops", "path": path, "timeout_s": 5}, model="ops-sglang"
    )
    clock = Clock()
    keys = [f"ops-{path}-{i}" for i in range(6)]
    pages = [torch.full((1024,), float(i + 1)) for i in range(6)]

    def backend() -> Any:
        made = SessionCacheHiCacheStorage(config)
        made.backoff = NodeBackoff(base=5.0, clock=clock)
        return made

    writer, reader = backend(), backend()
    try:
        assert writer.batch_set(keys, pages)
        out = [torch.zeros(1024) for _ in keys]
        kill_at_load()
        got = reader.batch_get(keys, out)
        assert got == [None] * 6  # a miss, never an exception into SGLang
        assert reader.backoff.down
        for o, p in zip(out, pages, strict=True):  # what landed is the page's, or nothing
            assert torch.equal(o, p) or torch.equal(o, torch.zeros(1024))
        node.restart()
        writer.close()
        writer = backend()
        assert writer.batch_set(keys, pages)
        start = time.monotonic()
        assert reader.batch_exists(keys) == 0  # within the backoff: at once
        assert reader.batch_get(keys, [torch.zeros(1024) for _ in keys]) == [None] * 6
        assert time.monotonic() - start < 1
        clock.now += 5.0
        assert reader.batch_exists(keys) == 6
        out = [torch.zeros(1024) for _ in keys]
        got = reader.batch_get(keys, out)
        assert all(g is not None for g in got)
        assert all(torch.equal(o, p) for o, p in zip(out, pages, strict=True))
    finally:
        writer.close()
        reader.close()


# -- LMCache's L2 adapter -----------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_lmcache_l2_batches_fail_while_the_node_is_down_then_reconnect(
    node: Node, kill_at_load: Callable[[], None], path: str
) -> None:
    clock = Clock()
    keys = [f"ops/m@{0:08x}@0@{i:032x}" for i in range(6)]
    blocks = payloads(6, 4)

    def adapter() -> SessionCacheL2:
        made = SessionCacheL2(
            node.url,
            "sk-ops",
            data_path=path,  # type: ignore[arg-type]
            workers=1,
            kv_layout="ops-l2",
            timeout_s=5,
        )
        made.backoff = NodeBackoff(clock=clock)
        return made

    l2 = adapter()
    try:
        assert wait_for(l2, l2.submit_batch_set(keys, blocks))[1]
        out = [bytearray(BLOCK) for _ in keys]
        kill_at_load()
        done = wait_for(l2, l2.submit_batch_get(keys, [memoryview(b) for b in out]))
        assert done[1] is False and done[3] is None  # the completion reports the failure
        assert l2.backoff.down
        assert all(bytes(o) in (bytes(BLOCK), b) for o, b in zip(out, blocks, strict=True))
        node.restart()
        other = adapter()
        try:
            assert wait_for(other, other.submit_batch_set(keys, blocks))[1]
        finally:
            other.close()
        start = time.monotonic()
        done = wait_for(l2, l2.submit_batch_exists(keys))
        assert done[1] is False and "NodeDown" in done[2]  # at once, no connection
        assert time.monotonic() - start < 1
        clock.now += 1.0
        out = [bytearray(BLOCK) for _ in keys]
        done = wait_for(l2, l2.submit_batch_get(keys, [memoryview(b) for b in out]))
        assert done[1:] == (True, "", [True] * 6)
        assert [bytes(o) for o in out] == blocks
    finally:
        l2.close()


def test_keyed_loads_of_several_requests_place_only_what_the_node_holds(node: Node) -> None:
    """``ops.load`` with placed targets (an engine's own copies) and keyed ids over
    several requests: every held block placed where it goes, a miss left alone."""
    keys = [block_key(f"k{i}") for i in range(9)]
    blocks = payloads(9, 5)
    with KVTransfer.from_url(node.url, api_key="sk-ops", path="stream") as kv:
        kv.store_keyed(NS, [k for i, k in enumerate(keys) if i != 5], blocks[:5] + blocks[6:])
        conn = kv.connection
        root = kv.root(NS)
        ids = conn.key_ids(root, keys)
        placed: dict[int, bytes] = {}

        def place(targets: Sequence[Any], views: Sequence[Any]) -> None:
            for t, v in zip(targets, views, strict=True):
                placed[t] = bytes(v)

        for prefix in (False, True):
            placed.clear()
            targets = ops.Targets.placed(list(range(9)), place, BLOCK, ops.Bounce())
            got = ops.load(conn, root, ids, targets, lease_ms=5000, keyed=True, prefix=prefix)
            want = [i != 5 for i in range(9)] if not prefix else [i < 5 for i in range(9)]
            assert got == want
            assert all(placed[i] == blocks[i] for i in range(9) if want[i])
            assert 5 not in placed
