"""An engine on the stream or the same host needs no REST call once connected, its sessions
included: a session's turns (open, load, store, finish with and without blocks, close) run
through ``KVTransfer`` and the vLLM worker's ``EngineNode`` while the node's REST API is
unreachable from the engine (the engine reaches it through a proxy that the test closes once
the data plane is connected). The node's own REST API, read directly, then shows the turns'
effects on the session."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from sessioncache.connector import ops
from sessioncache.connector.paged import EngineNode, NodeSettings, PagedLayout, Scope, Transfer
from sessioncache.connector.transfer import KVTransfer
from sessioncache.errors import TransportError
from sessioncache.hashing import Namespace
from tests.support.servers import Server, spawn_server, wait_ready

PATHS = ["same_host", "stream"]
KEYS = {"sk-turns": "turns"}
ENV = {
    "SESSIONCACHE_API_KEYS": json.dumps(KEYS),
    "SESSIONCACHE_SHM_TRUSTED_TENANTS": json.dumps(["turns"]),
}
NS = Namespace("rest-down-test", 4, "bfloat16", "paged")
LAYERS, BLOCKS, HEADS, CONTENT = 2, 8, 2, 16


class RestProxy:
    """A TCP proxy to the node's REST port, which ``close`` shuts: every REST call through it
    fails after that (connection refused), while the data plane goes to the node directly."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self._lock:
                self.accepted += 1
                self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes the blocked accept, stops listening
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self._lock:
            for s in self._open:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Server]:
    server = wait_ready(spawn_server(tmp_path / "data", ENV))
    yield server
    server.stop()


@pytest.fixture
def proxy(node: Server) -> Iterator[RestProxy]:
    port = int(node.url.rsplit(":", 1)[1])
    p = RestProxy(port)
    yield p
    p.close()


def session_of(node: Server, session_id: str) -> dict[str, object]:
    """The session as the node's REST API answers it (read by the test, not the engine)."""
    reply = httpx.get(
        f"{node.url}/v1/sessions/{session_id}", headers={"authorization": "Bearer sk-turns"}
    )
    return dict(reply.json()) if reply.status_code == 200 else {"status": reply.status_code}


def tokens(n_blocks: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 30_000, n_blocks * NS.block_tokens)]


def block_bytes() -> int:
    return LAYERS * HEADS * NS.block_tokens * CONTENT * 2


@pytest.mark.parametrize("path", PATHS)
def test_a_transfers_session_turns_need_no_rest_call(
    node: Server, proxy: RestProxy, path: str
) -> None:
    nbytes = block_bytes()
    turn1 = tokens(3, 1)
    turn2 = turn1 + tokens(2, 2)
    payloads = [bytes([i + 1]) * nbytes for i in range(5)]
    with KVTransfer.from_url(proxy.url, api_key="sk-turns", namespace=NS, path=path) as kv:
        assert kv.path == path  # connected: the one REST call, the data plane's address
        proxy.close()
        with pytest.raises(TransportError):  # REST is down from here on
            kv.client.list_sessions()
        ops.open_session(kv, "agent")
        out = [bytearray(nbytes) for _ in range(3)]
        assert kv.load_into(turn1, out, session_id="agent").blocks == 0
        stored = kv.store_from(turn1, payloads[:3], session_id="agent", finish_reason="tool_use")
        assert stored.blocks == 3
        out = [bytearray(nbytes) for _ in range(5)]
        assert kv.load_into(turn2, out, session_id="agent").blocks == 3
        assert [bytes(b) for b in out[:3]] == payloads[:3]
        kept = kv.store_from(turn2, payloads[3:], session_id="agent", first_block=3)
        assert kept.blocks == 2
        assert kv.store_from(turn2, [], session_id="agent", finish_reason="stop").blocks == 0
        seen = session_of(node, "agent")
        assert seen["last_finish"] == "stop" and seen["pinned"] and seen["head"], seen
        assert kv.carrier is not None
        kv.carrier.close_session("agent")
        assert session_of(node, "agent") == {"status": 404}
        assert proxy.accepted == 1, "the engine made a REST call after it connected"


def paged_cache(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(LAYERS, BLOCKS, HEADS, NS.block_tokens, CONTENT, generator=g).bfloat16()
    return {f"layer.{i}": buf[i] for i in range(LAYERS)}


@pytest.mark.parametrize("path", PATHS)
def test_an_engine_nodes_session_turns_need_no_rest_call(
    node: Server, proxy: RestProxy, path: str
) -> None:
    engine = EngineNode(NodeSettings(proxy.url, "sk-turns", path, timeout_s=5))
    saver_cache, loader_cache = paged_cache(1), paged_cache(2)
    saver, loader = PagedLayout(saver_cache, BLOCKS), PagedLayout(loader_cache, BLOCKS)
    scope = Scope(session_id="vllm-agent")
    prompt = tokens(4, 3)
    try:
        assert engine.connect(scope) == path
        proxy.close()
        assert engine.held_blocks(NS, prompt, scope) == 0  # opens the session, on the data plane
        first = Transfer("r1", prompt, 0, [1, 2, 3, 4], scope, finish_reason="tool_use")
        assert engine.save(NS, engine.unsent(NS, first), saver) == 4
        assert engine.held_blocks(NS, prompt, scope) == 4
        loaded = engine.load(NS, Transfer("r2", prompt, 0, [5, 6, 7, 0], scope), loader)
        assert loaded.blocks == 4
        for src, dst in zip([1, 2, 3, 4], [5, 6, 7, 0], strict=True):
            for name in saver_cache:
                assert torch.equal(saver_cache[name][src], loader_cache[name][dst])
        done = Transfer("r2", prompt, 4, [], scope, finish_reason="stop")
        assert engine.save(NS, done, saver) == 0  # the finish alone
        seen = session_of(node, "vllm-agent")
        assert seen["last_finish"] == "stop" and seen["pinned"] and seen["head"], seen
        assert proxy.accepted == 1, "the engine made a REST call after it connected"
    finally:
        engine.close()
        saver.close()
        loader.close()
