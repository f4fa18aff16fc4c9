"""The in-process remote storage plugin with LMCache's own engine (``lmcache==0.5.6``) on the
CPU: an ``LMCacheEngine`` configured by LMCache's keys stores a prompt's KV through a real node,
and a fresh engine (empty local cache) finds it and retrieves it byte for byte, partial last
chunk included, on both data paths."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
from lmcache.v1.metadata import LMCacheMetadata

from sessioncache.connector.lmcache_remote import SessionCacheRemoteConnector
from tests.sessioncache.connector.conftest import received_bytes
from tests.support.servers import Server, start_server

LAYERS, CHUNK, HEADS, HEAD_DIM = 2, 16, 2, 8


class CopyingGPUConnector(MockGPUConnector):  # type: ignore[misc]
    """LMCache's mock GPU connector, copying to and from a CPU tensor ``kvcaches`` of shape
    ``[2, layers, tokens, heads x head_dim]`` (the "GPU"), so that bytes can be compared."""

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
        memory_obj.tensor.copy_(kw["kvcaches"][:, :, start:end, :])

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
        kw["kvcaches"][:, :, start:end, :].copy_(memory_obj.tensor)

    def batched_from_gpu(self, objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
        for obj, start, end in zip(objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kw)

    def batched_to_gpu(self, objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
        for obj, start, end in zip(objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kw)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("lmcache-remote") / "data")
    yield server
    server.stop()


def engine(node: Server, data_path: str) -> tuple[str, Any]:
    """An engine configured as docs/lmcache.md says, with an empty local CPU cache."""
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=True,
        max_local_cpu_size=0.05,
        save_unfull_chunk=True,
        remote_storage_plugins=["sessioncache"],
        extra_config={
            "remote_storage_plugin.sessioncache.module_path": (
                "sessioncache.connector.lmcache_remote"
            ),
            "remote_storage_plugin.sessioncache.class_name": "SessionCacheConnectorAdapter",
            "remote_storage_plugin.sessioncache.url": node.url,
            "remote_storage_plugin.sessioncache.data_path": data_path,
        },
    )
    metadata = LMCacheMetadata(
        model_name=f"remote-test-{data_path}",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.float16,
        kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM),
        chunk_size=CHUNK,
    )
    name = f"test-{uuid.uuid4().hex[:8]}"
    connector = CopyingGPUConnector((LAYERS, 2, CHUNK, HEADS, HEAD_DIM))
    built = LMCacheEngineBuilder.get_or_create(
        name, config, metadata, connector, lambda t, r: None, lambda o, r: o
    )
    built.post_init()
    return name, built


def blocks(node: Server) -> int:
    stats = httpx.get(f"{node.url}/v1/stats", timeout=10).json()
    return int(stats["blocks"])


@pytest.mark.parametrize("data_path", ["same_host", "stream"])
def test_a_fresh_engine_retrieves_what_another_stored(node: Server, data_path: str):
    n = 4 * CHUNK + 6  # four full chunks and a partial one
    tokens = torch.randint(0, 30_000, (n,))
    kv = torch.randn(2, LAYERS, n, HEADS * HEAD_DIM, dtype=torch.float16)
    before = blocks(node)

    first, writer = engine(node, data_path)
    try:
        writer.store(tokens, kvcaches=kv)
        # LMCache's store returns before its remote puts finish, and its close frees the CPU
        # buffers without waiting for them (a put still reading one crashes the process): wait
        # for the node to hold the five chunks before the engine goes
        deadline = time.monotonic() + 30
        while blocks(node) < before + 5 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        LMCacheEngineBuilder.destroy(first)
    assert blocks(node) == before + 5

    second, reader = engine(node, data_path)
    try:
        assert reader.lookup(tokens) == n
        out = torch.zeros_like(kv)
        assert int(reader.retrieve(tokens, kvcaches=out).sum()) == n
        assert torch.equal(out, kv)
        other = torch.randint(30_000, 40_000, (n,))
        assert reader.lookup(other) == 0
    finally:
        LMCacheEngineBuilder.destroy(second)


def counted_puts(built: Any) -> list[int]:
    """How many batched puts the engine's sessioncache connector has finished (its store
    returns before they do, and its close frees the buffers they read)."""
    backend = built.storage_manager.storage_backends["RemoteBackend-sessioncache"]
    connector = backend.connection
    while not isinstance(connector, SessionCacheRemoteConnector):  # LMCache's wrappers
        connector = getattr(connector, "_connector", None) or connector.real_connector
    done = [0]
    put = connector._put_sync

    def counted(*args: Any, **kwargs: Any) -> None:
        try:
            put(*args, **kwargs)
        finally:
            done[0] += 1

    connector._put_sync = counted
    return done


def wait_puts(done: list[int], n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while done[0] < n and time.monotonic() < deadline:
        time.sleep(0.02)
    assert done[0] >= n


def test_chunks_the_node_holds_are_not_sent_again(node: Server):
    """A second engine storing the same prompt sends none of its chunks' payloads (only the
    new chunks of a longer prompt reach the node)."""
    n = 4 * CHUNK
    tokens = torch.randint(0, 30_000, (2 * n,))
    kv = torch.randn(2, LAYERS, 2 * n, HEADS * HEAD_DIM, dtype=torch.float16)
    chunk_bytes = 2 * LAYERS * CHUNK * HEADS * HEAD_DIM * 2
    first, writer = engine(node, "stream")
    try:
        done = counted_puts(writer)
        writer.store(tokens[:n], kvcaches=kv[:, :, :n])
        wait_puts(done, 1)
    finally:
        LMCacheEngineBuilder.destroy(first)
    held = blocks(node)

    second, again = engine(node, "stream")
    try:
        done = counted_puts(again)
        before = received_bytes(node, "stream")
        again.store(tokens[:n], kvcaches=kv[:, :, :n])
        wait_puts(done, 1)
        assert received_bytes(node, "stream") == before  # no chunk crossed
        assert blocks(node) == held
        again.store(tokens, kvcaches=kv)  # four held chunks, four new
        wait_puts(done, 2)
        sent = received_bytes(node, "stream") - before
        assert 4 * chunk_bytes < sent < 5 * chunk_bytes  # with their metadata
        assert blocks(node) == held + 4
    finally:
        LMCacheEngineBuilder.destroy(second)
