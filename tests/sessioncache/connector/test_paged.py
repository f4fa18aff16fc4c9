"""``connector.paged``: blocks of a paged KV cache (the layouts vLLM allocates) copied straight
to and from a real node, on both data-plane paths, for two tenants."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import replace

import httpx
import numpy as np
import pytest
import torch

from sessioncache.connector import paged
from sessioncache.connector.paged import EngineNode, NodeSettings, PagedLayout, Scope, Transfer
from sessioncache.errors import (
    AuthRefused,
    InvalidInput,
    LeaseLost,
    PayloadSizeError,
    SessionNotFound,
    StreamClosed,
)
from sessioncache.hashing import Namespace
from tests.support.servers import Server, start_server

LAYERS, BLOCKS, HEADS, TOKENS, CONTENT = 3, 12, 2, 4, 16
NS = Namespace("paged-test", TOKENS, "bfloat16", "paged-test")
KEYS = {"sk-alice": "alice", "sk-bob": "bob"}


def layer_major(num_blocks: int = BLOCKS, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """One backing allocation, layer ``l`` of block ``b`` at ``l * layer + b * page`` (vLLM's
    ``LBHNC``, the CPU backend's): each layer a contiguous ``[B, H, N, C]`` view."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(LAYERS, num_blocks, HEADS, TOKENS, CONTENT, generator=g).bfloat16()
    return {f"layer.{i}": buf[i] for i in range(LAYERS)}


def block_major(*, seed: int = 0) -> dict[str, torch.Tensor]:
    """vLLM's ``BLHNC``: the layers of one block adjacent, each layer a strided view."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(BLOCKS, LAYERS, HEADS, TOKENS, CONTENT, generator=g).bfloat16()
    return {f"layer.{i}": buf[:, i] for i in range(LAYERS)}


def kv_first(*, seed: int = 0) -> dict[str, torch.Tensor]:
    """K and V as leading planes of each layer, ``[2, B, N, H, D]``."""
    g = torch.Generator().manual_seed(seed)
    return {
        f"layer.{i}": torch.randn(2, BLOCKS, TOKENS, HEADS, CONTENT // 2, generator=g).bfloat16()
        for i in range(LAYERS)
    }


def expected(tensors: dict[str, torch.Tensor], block: int) -> bytes:
    """A sessioncache block: the layers' slices of ``block`` back to back (K before V)."""
    out = b""
    for t in tensors.values():
        planes = [t] if t.shape[0] == BLOCKS else [t[0], t[1]]
        for p in planes:
            out += p[block].contiguous().view(torch.uint8).numpy().tobytes()
    return out


@pytest.mark.parametrize("make", [layer_major, block_major, kv_first])
def test_gather_and_scatter_move_each_layers_slice(make) -> None:  # type: ignore[no-untyped-def]
    src, dst = make(seed=1), make(seed=2)
    layout, into = PagedLayout(src, BLOCKS), PagedLayout(dst, BLOCKS)
    assert layout.nbytes == LAYERS * HEADS * TOKENS * CONTENT * 2
    assert len(layout.runs) == (
        1 if make is block_major else LAYERS * (2 if make is kv_first else 1)
    )
    out = [np.empty(layout.nbytes, np.uint8) for _ in range(3)]
    layout.gather([5, 0, 11], out)
    assert [o.tobytes() for o in out] == [expected(src, b) for b in (5, 0, 11)]
    into.scatter([7, 1, 2], out)
    for b_src, b_dst in ((5, 7), (0, 1), (11, 2)):
        assert expected(dst, b_dst) == expected(src, b_src)
    untouched = make(seed=2)
    assert expected(dst, 3) == expected(untouched, 3)  # only the blocks named change


def test_a_layout_refuses_what_would_write_outside_the_cache() -> None:
    layout = PagedLayout(layer_major(), BLOCKS)
    block = np.zeros(layout.nbytes, np.uint8)
    with pytest.raises(InvalidInput):
        layout.scatter([BLOCKS], [block])
    with pytest.raises(InvalidInput):
        layout.scatter([-1], [block])
    with pytest.raises(PayloadSizeError):
        layout.scatter([0], [np.zeros(layout.nbytes - 1, np.uint8)])
    with pytest.raises(PayloadSizeError):
        layout.gather([0], [np.zeros(layout.nbytes + 1, np.uint8)])
    block.flags.writeable = False
    with pytest.raises(InvalidInput):
        layout.gather([0], [block])
    with pytest.raises(InvalidInput):  # a block's slice with gaps
        PagedLayout({"x": torch.zeros(BLOCKS, 4, 8)[:, :, ::2]}, BLOCKS)
    with pytest.raises(InvalidInput):
        PagedLayout({"x": torch.zeros(7, 4)}, BLOCKS)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("paged") / "data",
        {
            "SESSIONCACHE_API_KEYS": json.dumps(KEYS),
            "SESSIONCACHE_SHM_TRUSTED_TENANTS": json.dumps(sorted(KEYS.values())),
        },
    )
    yield server
    server.stop()


def tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 30_000, n)]


@pytest.mark.parametrize("path", ["same_host", "stream"])
def test_an_engine_saves_and_another_loads_into_its_paged_blocks(node: Server, path: str) -> None:
    prompt = tokens(8 * TOKENS, 10 if path == "stream" else 11)
    session = f"paged-{path}"
    alice = EngineNode(NodeSettings(node.url, "sk-alice", path, timeout_s=10))
    engine_a = layer_major(seed=3)
    layout_a = PagedLayout(engine_a, BLOCKS)
    blocks_a = [4, 9, 0, 2, 7, 1, 11, 3]
    scope = Scope(session_id=session)
    try:
        assert alice.held_blocks(NS, prompt, scope) == 0
        # the first two blocks first, then the rest hanging off them
        assert (
            alice.save(NS, Transfer("a0", prompt[: 2 * TOKENS], 0, blocks_a[:2], scope), layout_a)
            == 2
        )
        assert alice.save(NS, Transfer("a1", prompt, 2, blocks_a[2:], scope), layout_a) == 6
        assert alice.held_blocks(NS, prompt, scope) == 8
    finally:
        alice.close()

    # Engine B of the same tenant, a fresh cache: loads blocks 1.. (block 0 it computed)
    engine_b = layer_major(seed=4)
    layout_b = PagedLayout(engine_b, BLOCKS)
    blocks_b = [10, 5, 6, 8, 0, 2, 1]
    b = EngineNode(NodeSettings(node.url, "sk-alice", path, timeout_s=10))
    try:
        b.connect()  # on the same host: the node's memory mapped ahead of the first load
        conn = b.kv(Scope()).connection
        assert bool(getattr(conn, "mapped_segments", None)) == (path == "same_host")
        assert b.load(NS, Transfer("b", prompt, 1, blocks_b, scope), layout_b).blocks == 7
    finally:
        b.close()
    for src, dst in zip(blocks_a[1:], blocks_b, strict=True):
        assert expected(engine_b, dst) == expected(engine_a, src)

    # Bob, another tenant, asks for the same tokens: a miss, and nothing is written.
    bob = EngineNode(NodeSettings(node.url, "sk-bob", path, timeout_s=10))
    engine_c = layer_major(seed=5)
    before = [expected(engine_c, i) for i in range(BLOCKS)]
    try:
        assert bob.held_blocks(NS, prompt, Scope()) == 0
        assert (
            bob.load(
                NS, Transfer("c", prompt, 0, blocks_b[:8], Scope()), PagedLayout(engine_c, BLOCKS)
            ).blocks
            == 0
        )
        # a request's own key: the tenant is alice's, over bob's engine
        own = Scope(session_id=session, api_key="sk-alice")
        assert bob.held_blocks(NS, prompt, own) == 8
    finally:
        bob.close()
    assert [expected(engine_c, i) for i in range(BLOCKS)] == before

    info = httpx.get(
        f"{node.url}/v1/sessions/{session}", headers={"Authorization": "Bearer sk-alice"}
    ).json()
    assert info["tenant"] == "alice" and info["pinned"]
    assert info["attribution"]["hit_tokens"] >= 8 * TOKENS


def counters(node: Server) -> dict[str, float]:
    """The node-wide series a probe must not move, and the stream's received bytes."""
    text = httpx.get(f"{node.url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith(("sessioncache_hit_tokens", "sessioncache_miss_tokens")) or name in (
            "sessioncache_lookups_total",
            'sessioncache_received_payload_bytes_total{carrier="stream"}',
        ):
            out[name] = float(value)
    return out


def test_a_save_sends_only_the_blocks_past_those_the_node_holds(node: Server) -> None:
    prompt = tokens(8 * TOKENS, 12)
    engine = layer_major(seed=7)
    layout = PagedLayout(engine, BLOCKS)
    blocks = [4, 9, 0, 2, 7, 1, 11, 3]
    alice = EngineNode(NodeSettings(node.url, "sk-alice", "stream", timeout_s=10))
    session = Scope(session_id="paged-unsent")
    try:
        alice.kv(session).client.open_session("paged-unsent")
        assert alice.save(NS, Transfer("t1", prompt[: 5 * TOKENS], 0, blocks[:5]), layout) == 5
        before = counters(node)
        whole = Transfer("t2", prompt, 0, blocks, session, "tool_use")
        sent = alice.unsent(NS, whole)
        assert (sent.first, sent.block_ids, sent.finish_reason) == (5, blocks[5:], "tool_use")
        assert counters(node) == before  # the probe is no lookup: nothing counted
        assert alice.save(NS, sent, layout) == 3
        after = counters(node)
        stream = 'sessioncache_received_payload_bytes_total{carrier="stream"}'
        assert after.pop(stream) - before.pop(stream) == 3 * layout.nbytes
        assert after == before
        # all held: a session's save keeps its last block (its chain and head move there)
        assert alice.unsent(NS, whole).block_ids == blocks[7:]
        assert alice.unsent(NS, replace(whole, scope=Scope())).block_ids == []
    finally:
        alice.close()
    info = httpx.get(
        f"{node.url}/v1/sessions/paged-unsent", headers={"Authorization": "Bearer sk-alice"}
    ).json()
    assert info["pinned"] and info["head"] is not None


@pytest.mark.parametrize("path", ["same_host", "stream"])
def test_a_session_the_node_closed_is_opened_again_by_the_next_request(
    node: Server, path: str
) -> None:
    # The engine remembers the sessions it opened; the node may close one since (its TTL, an
    # operator, a replaced node). The next request opens it again, not 404s for good.
    prompt = tokens(4 * TOKENS, 20 if path == "stream" else 21)
    layout = PagedLayout(layer_major(seed=8), BLOCKS)
    sid = f"paged-reopened-{path}"
    url = f"{node.url}/v1/sessions/{sid}"
    auth = {"Authorization": "Bearer sk-alice"}
    alice = EngineNode(NodeSettings(node.url, "sk-alice", path, timeout_s=10))
    scope = Scope(session_id=sid)
    try:
        assert alice.held_blocks(NS, prompt, scope) == 0  # opens it
        assert alice.save(NS, Transfer("r1", prompt, 0, [0, 1, 2, 3], scope), layout) == 4
        assert httpx.delete(url, headers=auth, timeout=10).status_code == 204
        assert httpx.get(url, headers=auth, timeout=10).status_code == 404
        assert alice.held_blocks(NS, prompt, scope) == 4  # the blocks stay; the session is back
        assert httpx.get(url, headers=auth, timeout=10).status_code == 200
        # and a save the node refuses for a closed session opens it at the next request
        assert httpx.delete(url, headers=auth, timeout=10).status_code == 204
        longer = tokens(5 * TOKENS, 20 if path == "stream" else 21)
        with pytest.raises(SessionNotFound):
            alice.save(NS, Transfer("r2", longer, 4, [4], scope), layout)
        assert alice.held_blocks(NS, prompt, scope) == 4
        assert httpx.get(url, headers=auth, timeout=10).json()["pinned"]
    finally:
        alice.close()


def test_an_engine_remembers_a_bounded_number_of_opened_sessions(
    node: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(paged, "OPENED_SESSIONS", 2)
    prompt = tokens(2 * TOKENS, 22)
    alice = EngineNode(NodeSettings(node.url, "sk-alice", "stream", timeout_s=10))
    try:
        for sid in ("bounded-1", "bounded-2", "bounded-3", "bounded-1"):
            assert alice.held_blocks(NS, prompt, Scope(session_id=sid)) == 0
        assert list(alice._sessions) == [(None, "bounded-3"), (None, "bounded-1")]
    finally:
        alice.close()


def test_a_node_that_is_gone_fails_the_calls_and_writes_nothing(node: Server) -> None:
    engine = layer_major(seed=6)
    before = [expected(engine, i) for i in range(BLOCKS)]
    gone = EngineNode(NodeSettings("http://127.0.0.1:9", timeout_s=2))
    with pytest.raises(Exception):  # noqa: B017 - any failure: the connector recomputes
        gone.load(
            NS, Transfer("x", tokens(4 * TOKENS, 1), 0, [0, 1, 2, 3]), PagedLayout(engine, BLOCKS)
        )
    gone.close()
    assert [expected(engine, i) for i in range(BLOCKS)] == before


def test_a_silent_node_costs_one_timeout_per_backoff() -> None:
    """A node that accepts connections and never answers (a half-open peer): the first call
    times out; after ``failed`` the node is ``down`` (callers skip it) for a backoff that
    doubles, and ``ok`` ends the run of failures."""
    now = [100.0]
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        engine = EngineNode(NodeSettings(url, timeout_s=0.5), clock=lambda: now[0])
        start = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - a timeout, in whichever layer
            engine.held_blocks(NS, tokens(4 * TOKENS, 1), Scope())
        assert time.monotonic() - start < 5
    assert not engine.down
    assert engine.failed() == 1.0 and engine.down
    now[0] += 1.0
    assert not engine.down
    assert engine.failed() == 2.0 and engine.failed() == 4.0
    now[0] += 3.9
    assert engine.down
    engine.ok()
    assert engine.failed() == 1.0  # a new run of failures starts over


def test_a_refused_request_leaves_the_node_up_for_the_others() -> None:
    """A request the node refuses (bad input, an unknown key, a tenant's bound) misses alone;
    a failure of the node or the carrier backs off."""
    engine = EngineNode(NodeSettings("http://127.0.0.1:9"), clock=lambda: 0.0)
    for refusal in (InvalidInput("too many ids"), AuthRefused("unknown key"), LeaseLost("gone")):
        assert engine.failure(refusal) is None and not engine.down
    assert engine.failure(StreamClosed("reset")) == 1.0 and engine.down
