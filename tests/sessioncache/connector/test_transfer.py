"""KVTransfer against a real node: every path moves the same bytes; auto takes the fastest."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from sessioncache.connector import SessionCacheClient
from sessioncache.connector.transfer import KVTransfer
from sessioncache.errors import InvalidInput
from sessioncache.hashing import Namespace
from tests.support.servers import Server, start_server

BLOCK = 64 * 1024


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("transfer") / "data")
    yield server
    server.stop()


def client_for(node: Server, model: str) -> SessionCacheClient:
    return SessionCacheClient(node.url, namespace=Namespace(model, 16, "bf16", "x"))


def payloads(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(n)]


@pytest.mark.parametrize("path", ["same_host", "stream", "rest"])
def test_every_path_stores_and_loads_the_same_bytes(node: Server, path: str):
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 50_000, 16 * 6 + 5)]
    blocks = payloads(2, 6)
    with client_for(node, f"m-{path}") as client, KVTransfer(client, path=path) as kv:  # type: ignore[arg-type]
        assert kv.path == path
        stored = kv.store_from(tokens, blocks)
        assert (stored.path, stored.blocks, stored.nbytes) == (path, 6, 6 * BLOCK)
        out = [np.zeros(BLOCK, dtype=np.uint8) for _ in range(8)]
        loaded = kv.load_into(tokens, out)
        assert (loaded.path, loaded.blocks, loaded.nbytes) == (path, 6, 6 * BLOCK)
        for got, want in zip(out, blocks, strict=False):
            assert np.array_equal(got, want)
        assert not out[6].any()
        # Another prompt sharing 4 blocks: 4 load.
        other = tokens[: 16 * 4] + [7] * 32
        assert kv.load_into(other, out).blocks == 4


def test_auto_takes_the_same_host_path_and_sessions_learn_their_chain(node: Server):
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 50_000, 16 * 3)]
    with client_for(node, "m-auto") as client, KVTransfer(client) as kv:
        assert kv.path == "same_host"
        session = client.open_session(kind="agent")
        kv.store_from(tokens, payloads(4, 3), session_id=session.id)
        assert client.get_session(session.id).head == client.block_hashes(tokens)[-1]
        out = [np.zeros(BLOCK, dtype=np.uint8) for _ in range(3)]
        assert kv.load_into(tokens, out, session_id=session.id).blocks == 3


def test_a_forced_path_is_checked(node: Server):
    with client_for(node, "m-bad") as client, pytest.raises(InvalidInput):
        KVTransfer(client, path="carrier-pigeon")  # type: ignore[arg-type]


def test_same_host_is_refused_for_a_node_elsewhere(node: Server, tmp_path: Path):
    with client_for(node, "m-far") as client:
        kv = KVTransfer(client, path="auto")
        client.same_host = lambda **_: (_ for _ in ()).throw(OSError("not here"))  # type: ignore[method-assign]
        assert kv.path == "stream"
        kv.close()
