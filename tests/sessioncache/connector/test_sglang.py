"""SGLang's own ``StorageBackendFactory`` loads ``SessionCacheHiCacheStorage`` and stores and
reads back pages byte-exact through a real ``sessioncache serve``, on both data paths.

The real ``sglang`` package is needed (installed without its GPU dependencies, see .ci/run).
SGLang's host KV pools (``sglang.srt.mem_cache.pool_host``) cannot be imported without
torchvision built for the installed torch, so ``PageFirstHostPool`` stands in for
``MHATokenToKVPoolHost``: the same buffer and the same ``get_page_buffer_meta`` arithmetic for
its ``page_first`` and ``layer_first`` layouts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from sessioncache.connector import SessionCacheClient  # noqa: E402
from sessioncache.connector.sglang import (  # noqa: E402
    HiCacheOptions,
    SessionCacheHiCacheStorage,
    shard_tag,
)
from sessioncache.errors import InvalidInput  # noqa: E402
from sessioncache.hashing import block_key  # noqa: E402
from tests.sessioncache.connector.conftest import received_bytes  # noqa: E402
from tests.support.adapters import hicache_config  # noqa: E402
from tests.support.servers import Server, start_server  # noqa: E402

MODULE = "sessioncache.connector.sglang"
CLASS = "SessionCacheHiCacheStorage"
LAYERS, HEADS, DIM, PAGE = 4, 2, 64, 16
KEYS = {"k1": "t1", "k2": "t2"}  # t1 may use the same-host path, t2 may not


class PageFirstHostPool:
    """The storage-facing surface of SGLang's ``MHATokenToKVPoolHost`` (see module doc)."""

    def __init__(self, pages: int, layout: str = "page_first") -> None:
        self.page_size = PAGE
        self.layout = layout
        self.dtype = torch.bfloat16
        self.layer_num, self.head_num, self.head_dim = LAYERS, HEADS, DIM
        self.size = pages * PAGE
        if layout == "page_first":
            dims = (2, self.size, LAYERS, HEADS, DIM)
        else:
            dims = (2, LAYERS, self.size, HEADS, DIM)
        self.kv_buffer = torch.zeros(dims, dtype=self.dtype)

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        # MHATokenToKVPoolHost.get_page_buffer_meta, verbatim in its arithmetic
        assert len(indices) % self.page_size == 0
        base = self.kv_buffer.data_ptr()
        item = self.dtype.itemsize
        indices = indices.tolist()
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * item
        ptrs: list[int] = []
        if self.layout == "layer_first":
            for index in range(0, len(indices), self.page_size):
                for layer in range(self.layer_num):
                    k = (
                        base
                        + indices[index] * self.head_num * self.head_dim * item
                        + layer * self.size * self.head_num * self.head_dim * item
                    )
                    ptrs += [k, k + v_offset]
            size = item * self.page_size * self.head_num * self.head_dim
        else:
            for index in range(0, len(indices), self.page_size):
                k = base + indices[index] * self.layer_num * self.head_num * self.head_dim * item
                ptrs += [k, k + v_offset]
            size = self.layer_num * item * self.page_size * self.head_num * self.head_dim
        return ptrs, [size] * len(ptrs)

    def page(self, index: int) -> Any:
        if self.layout == "page_first":
            return self.kv_buffer[:, index : index + PAGE].clone()
        return self.kv_buffer[:, :, index : index + PAGE].clone()

    def fill(self, index: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        data = torch.randn(self.page(index).shape, generator=g).to(self.dtype)
        if self.layout == "page_first":
            self.kv_buffer[:, index : index + PAGE] = data
        else:
            self.kv_buffer[:, :, index : index + PAGE] = data


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {
        # a 64 MiB chunk per payload size in use (tiers/slab.py): room for the two sizes here
        "SESSIONCACHE_CPU_BYTES": str(256 << 20),
        # requests of 8 blocks at most: every batch here takes several
        "SESSIONCACHE_STREAM_MAX_IDS": "8",
        "SESSIONCACHE_API_KEYS": json.dumps(KEYS),
        "SESSIONCACHE_SHM_TRUSTED_TENANTS": json.dumps(["t1"]),
    }
    server = start_server(tmp_path_factory.mktemp("sglang") / "data", env)
    yield server
    server.stop()


def storage_config(extra: dict[str, Any], *, model: str, tp_rank: int = 0) -> Any:
    return hicache_config(extra, model=model, tp_rank=tp_rank, tp_size=2)


def create(node: Server, model: str, **extra: Any) -> Any:
    """The backend as SGLang builds it from ``--hicache-storage-backend dynamic``."""
    config = {
        "backend_name": "sessioncache",
        "module_path": MODULE,
        "class_name": CLASS,
        "url": node.url,
        "api_key": "k1",
        **extra,
    }
    # what SGLang's server_args does with --hicache-storage-backend-extra-config
    config = json.loads(json.dumps(config))
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(config, model=model, tp_rank=extra.pop("tp_rank", 0)), None
    )
    assert isinstance(backend, SessionCacheHiCacheStorage)
    return backend


def keys_for(tag: str, n: int) -> list[str]:
    return [f"{tag}-{i:064x}" for i in range(n)]


@pytest.mark.parametrize("path", ["same_host", "stream"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_zero_copy_pages_round_trip_through_the_factory(node: Server, path: str, layout: str):
    pages = 6
    writer = create(node, f"m-v1-{path}-{layout}", path=path, interface_v1=True)
    reader = create(node, f"m-v1-{path}-{layout}", path=path, interface_v1=True)
    src, dst = PageFirstHostPool(pages + 2, layout), PageFirstHostPool(pages + 2, layout)
    writer.register_mem_pool_host(src)
    reader.register_mem_pool_host(dst)
    try:
        assert writer.path == path
        keys = keys_for(f"{path}-{layout}", pages)
        at = torch.arange(PAGE, PAGE * (pages + 1), dtype=torch.int64)  # pages 1..6 of the pool
        for i in range(pages):
            src.fill(PAGE * (i + 1), seed=i)
        assert reader.batch_exists(keys) == 0
        # two batches of one request: the second continues the first's chain
        assert writer.batch_set_v1(keys[:4], at[: 4 * PAGE]) == [True] * 4
        extra = HiCacheStorageExtraInfo(prefix_keys=keys[:4])
        assert writer.batch_set_v1(keys[4:], at[4 * PAGE :], extra) == [True] * 2
        assert reader.batch_exists(keys + keys_for("absent", 2)) == pages
        assert reader.exists(keys[0]) and not reader.exists("absent")

        # into other slots of another pool: pages 7, 0, 1, ... of dst
        into = torch.cat([torch.arange(PAGE * (pages + 1), PAGE * (pages + 2)), at[:-PAGE]])
        got = reader.batch_get_v1(keys, into.to(torch.int64))
        assert got == [True] * pages
        order = [pages + 1, *range(1, pages)]
        for i, slot in enumerate(order):
            assert torch.equal(dst.page(PAGE * slot), src.page(PAGE * (i + 1))), i
        # a missing page in the middle: SGLang keeps the prefix before it
        mixed = [keys[0], "absent-page", keys[2]]
        assert reader.batch_get_v1(mixed, at[: 3 * PAGE])[:2] == [True, False]
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize("path", ["same_host", "stream"])
def test_tensor_pages_round_trip_through_the_factory(node: Server, path: str):
    backend = create(node, f"m-pages-{path}", path=path)
    try:
        rng = np.random.default_rng(7)
        pages = [torch.from_numpy(rng.standard_normal(4096).astype(np.float32)) for _ in range(5)]
        keys = keys_for(f"pages-{path}", 5)
        assert backend.batch_set(keys[:4], pages[:4])
        assert backend.set(keys[4], pages[4])
        assert backend.batch_exists(keys) == 5
        out = [torch.zeros(4096, dtype=torch.float32) for _ in range(6)]
        got = backend.batch_get([*keys, "never-stored"], out)
        assert got[5] is None
        for a, b in zip(got[:5], pages, strict=True):
            assert a is not None and torch.equal(a, b)
        one = backend.get(keys[2], torch.zeros(4096, dtype=torch.float32))
        assert one is not None and torch.equal(one, pages[2])
        assert backend.get("never-stored", torch.zeros(4096)) is None
    finally:
        backend.close()


def test_ranks_and_formats_do_not_share_pages(node: Server):
    rank0 = create(node, "m-ranks", tp_rank=0)
    rank1 = create(node, "m-ranks", tp_rank=1)
    v1 = create(node, "m-ranks", tp_rank=0, interface_v1=True)
    v1.register_mem_pool_host(PageFirstHostPool(2))
    try:
        page = torch.ones(1024, dtype=torch.float32)
        assert rank0.set("shared-key", page)
        assert rank0.exists("shared-key")
        assert not rank1.exists("shared-key")  # TP-split KV: another rank's page differs
        assert not v1.exists("shared-key")  # another page format
    finally:
        for b in (rank0, rank1, v1):
            b.close()


@pytest.mark.parametrize("prefix", [True, False])
def test_a_written_sequence_is_one_chain(node: Server, prefix: bool):
    """Batches that name the pages before them continue their chain: a chain LOOKUP of the
    blocks from the first matches them all; without prefix_keys each batch is a chain."""
    backend = create(node, f"m-chain-{prefix}", path="stream", interface_v1=True)
    pool = PageFirstHostPool(3)
    backend.register_mem_pool_host(pool)
    try:
        keys = keys_for(f"chain-{prefix}", 3)
        at = torch.arange(0, 3 * PAGE, dtype=torch.int64)
        assert all(backend.batch_set_v1(keys[:2], at[: 2 * PAGE]))
        extra = HiCacheStorageExtraInfo(prefix_keys=keys[:2] if prefix else None)
        assert all(backend.batch_set_v1(keys[2:], at[2 * PAGE :], extra))
        blocks = [f"{k}#{j}" for k in keys for j in range(2)]  # K and V of each page
        ns = backend.namespace()
        with SessionCacheClient(node.url, namespace=ns, api_key="k1") as c, c.stream() as stream:
            root = stream.resolve(ns)
            ids = stream.key_ids(root, [block_key(b) for b in blocks])
            assert stream.lookup(root, ids).matched == (6 if prefix else 4)
    finally:
        backend.close()


def test_pages_the_node_holds_are_not_sent_again(node: Server):
    """A batch of held pages sends the node no payload; held and new pages in one
    batch send the new ones only, and the chain goes on through the held ones."""
    backend = create(node, "m-resend", path="stream", interface_v1=True)
    pool = PageFirstHostPool(4)
    backend.register_mem_pool_host(pool)
    page_bytes = 2 * LAYERS * PAGE * HEADS * DIM * 2  # K and V, bf16
    try:
        keys = keys_for("resend", 4)
        at = torch.arange(0, 4 * PAGE, dtype=torch.int64)
        for i in range(4):
            pool.fill(PAGE * i, seed=100 + i)
        assert backend.batch_set_v1(keys[:2], at[: 2 * PAGE]) == [True] * 2
        before = received_bytes(node, "stream")
        assert backend.batch_set_v1(keys[:2], at[: 2 * PAGE]) == [True] * 2
        assert received_bytes(node, "stream") == before
        assert backend.batch_set_v1(keys, at) == [True] * 4
        assert received_bytes(node, "stream") - before == 2 * page_bytes
        blocks = [f"{k}#{j}" for k in keys for j in range(2)]
        ns = backend.namespace()
        with SessionCacheClient(node.url, namespace=ns, api_key="k1") as c, c.stream() as stream:
            root = stream.resolve(ns)
            ids = stream.key_ids(root, [block_key(b) for b in blocks])
            assert stream.lookup(root, ids).matched == 8  # one chain
    finally:
        backend.close()


def test_tenants_do_not_share_pages(node: Server):
    mine = create(node, "m-tenants")
    theirs = create(node, "m-tenants", api_key="k2")
    try:
        assert mine.path == "same_host"  # t1 is trusted with it
        assert theirs.path == "stream"  # t2 is not: auto falls back to the stream
        page = torch.full((4096,), 1.5)
        assert mine.set("tenant-key", page)
        assert mine.exists("tenant-key") and not theirs.exists("tenant-key")
        assert theirs.set("tenant-key", torch.full((4096,), 2.5))
        out = mine.get("tenant-key", torch.zeros(4096))
        assert out is not None and torch.equal(out, page)
    finally:
        mine.close()
        theirs.close()


def test_an_unreachable_node_fails_calls_not_sglang(tmp_path: Any):
    backend = create(
        Server("http://127.0.0.1:9", 9, None, tmp_path, tmp_path / "log"),  # type: ignore[arg-type]
        "m-down",
        timeout_s=2,
    )
    try:
        assert backend.batch_exists(["a", "b"]) == 0
        assert backend.batch_set(["a"], [torch.zeros(16)]) is False
        assert backend.batch_get(["a"], [torch.zeros(16)]) == [None]
    finally:
        backend.close()


def test_options_are_checked():
    with pytest.raises(InvalidInput, match="path must be"):
        HiCacheOptions.from_extra_config({"path": "rest"})
    opts = HiCacheOptions.from_extra_config({"url": "http://n:1", "interface_v1": 1, "ttl_s": 60})
    assert (opts.url, opts.interface_v1, opts.ttl_s) == ("http://n:1", True, 60.0)


def test_shards_follow_sglangs_file_backend():
    mla = HiCacheStorageConfig(3, 4, 0, 1, 0, 1, True, False, True, "m")
    assert shard_tag(mla) == "single"  # MLA KV: one copy for every TP rank
    mha = HiCacheStorageConfig(3, 4, 1, 2, 0, 1, False, False, True, "m")
    assert shard_tag(mha) == "tp3of4,pp1of2"


def test_the_core_never_imports_sglang():
    code = (
        "import sys, sessioncache, sessioncache.connector, sessioncache.connector.transfer, "
        "sessioncache.cli, sessioncache.node, sessioncache.api.app; "
        "print('sglang' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


class SplitHostPool(PageFirstHostPool):
    """Pages of two regions of different sizes (as MLA's page_first_kv_split gives)."""

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        ptrs, sizes = super().get_page_buffer_meta(indices)
        return ptrs, [s if i % 2 == 0 else s // 2 for i, s in enumerate(sizes)]


def test_regions_of_several_sizes_fail_the_call_not_sglang(node: Server):
    backend = create(node, "m-split", interface_v1=True)
    backend.register_mem_pool_host(SplitHostPool(2))
    try:
        at = torch.arange(0, 2 * PAGE, dtype=torch.int64)
        assert backend.batch_set_v1(["a", "b"], at) == [False, False]
        assert backend.batch_get_v1(["a", "b"], at) == [False, False]
        assert backend.batch_exists(["a", "b"]) == 0
    finally:
        backend.close()
