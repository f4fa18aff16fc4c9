"""SGLang HiCache pages through ``SessionCacheHiCacheStorage`` (docs/sglang.md): GB/s of the
zero-copy ``batch_set_v1`` / ``batch_get_v1`` a real SGLang storage thread calls, against a real
``sessioncache serve``, on the same-host path (shared memory) and on the stream, beside
references measured in the same run on the same pages:

- memcpy: copying every region of the pages from one host pool into another (``copy_``), the
          memory bound of this machine;
- SGLang's own file backend (``HiCacheFile``, ``--hicache-storage-backend file``) on a
          temporary folder (the page cache: no disk in it), through the tensor interface its
          storage thread uses (``get_data_page`` / ``batch_set``, ``batch_get`` /
          ``set_from_flat_data_page``).

The host pool is page-first, SGLang's layout for storage backends (K and V of a page are one
region each): ``--layers`` x ``--page-tokens`` x ``--heads`` x ``--dim`` bf16 per region, by
default 16 x 64 x 8 x 128 (2 MiB, Llama-3.1-8B's KV heads on one GPU, half its layers). A round
stores ``--pages`` pages under fresh keys in batches of 128 (SGLang's ``STORAGE_BATCH_SIZE``),
each batch continuing the chain of the ones before it, then reads them back into another pool
(checked byte for byte in the warm-up). Each figure is the best of ``--repeats``. Two warm-up
rounds per case are not counted: they map the node's segments and fill its CPU tier (sized to
two rounds), so that the measured stores evict and reuse slots, as in a node in service.

Run: ``python -m bench.sglang_hicache [--pages 32] [--layers 16] [--repeats 3] [--json]``
(needs the ``sglang`` package; see docs/sglang.md for installing it on a CPU-only machine).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from bench.lookup import start
from sessioncache.connector.sglang import SessionCacheHiCacheStorage

BATCH = 128  # sglang.srt.mem_cache.hicache_storage.STORAGE_BATCH_SIZE


class HostPool:
    """A page-first host KV pool: ``MHATokenToKVPoolHost``'s buffer and storage-facing
    methods (``get_page_buffer_meta``, ``get_data_page``, ``set_from_flat_data_page``)."""

    def __init__(self, pages: int, page: int, layers: int, heads: int, dim: int) -> None:
        self.page_size, self.layout, self.dtype = page, "page_first", torch.bfloat16
        self.layer_num, self.head_num, self.head_dim = layers, heads, dim
        self.size = pages * page
        self.kv_buffer = torch.empty((2, self.size, layers, heads, dim), dtype=self.dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        item = self.dtype.itemsize
        row = self.layer_num * self.head_num * self.head_dim * item
        v_offset = self.size * row
        base = self.kv_buffer.data_ptr()
        ptrs: list[int] = []
        for first in indices.tolist()[:: self.page_size]:
            ptrs += [base + first * row, base + first * row + v_offset]
        return ptrs, [row * self.page_size] * len(ptrs)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, index : index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.empty(self.get_data_page(0).numel(), dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data: torch.Tensor) -> None:
        shape = self.kv_buffer[:, index : index + self.page_size].shape
        self.kv_buffer[:, index : index + self.page_size] = data.reshape(shape)


def storage_config(extra: dict[str, Any]) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="bench/hicache",
        extra_config=extra,
    )


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Case:
    """One backend pair (writing from ``src``, reading into ``dst``), storing fresh keys and
    reading them back round after round."""

    def __init__(
        self, writer: Any, reader: Any, src: HostPool, dst: HostPool, pages: int, v1: bool
    ) -> None:
        self.writer, self.reader, self.src, self.dst = writer, reader, src, dst
        self.pages, self.v1 = pages, v1
        self.indices = torch.arange(pages * src.page_size, dtype=torch.int64)
        self.round = 0
        self.keys: list[str] = []

    def store(self) -> float:
        self.round += 1
        keys = [f"{id(self):x}-{self.round}-{i:060x}" for i in range(self.pages)]
        page = self.src.page_size

        def run() -> None:
            for first in range(0, len(keys), BATCH):
                batch = keys[first : first + BATCH]
                if self.v1:
                    at = self.indices[first * page : (first + len(batch)) * page]
                    extra = HiCacheStorageExtraInfo(prefix_keys=keys[:first])
                    ok = all(self.writer.batch_set_v1(batch, at, extra))
                else:
                    data = [self.src.get_data_page((first + i) * page) for i in range(len(batch))]
                    ok = self.writer.batch_set(batch, data)
                if not ok:
                    raise RuntimeError("a page was not stored: is the node's CPU tier too small?")

        seconds = timed(run)
        self.keys = keys
        return seconds

    def load(self) -> float:
        keys, page = self.keys, self.src.page_size

        def run() -> None:
            for first in range(0, len(keys), BATCH):
                batch = keys[first : first + BATCH]
                if self.v1:
                    at = self.indices[first * page : (first + len(batch)) * page]
                    if not all(self.reader.batch_get_v1(batch, at)):
                        raise RuntimeError("a page was not read back")
                    continue
                out = [self.dst.get_dummy_flat_data_page() for _ in batch]
                for i, data in enumerate(self.reader.batch_get(batch, out)):
                    if data is None:
                        raise RuntimeError("a page was not read back")
                    self.dst.set_from_flat_data_page((first + i) * page, data)

        return timed(run)

    def check(self) -> None:
        """One load into a zeroed pool, compared byte for byte with the pages stored."""
        self.dst.kv_buffer.zero_()
        self.load()
        if not torch.equal(self.dst.kv_buffer, self.src.kv_buffer):
            raise RuntimeError("the pages read back differ from the pages stored")

    def close(self) -> None:
        for backend in {id(self.writer): self.writer, id(self.reader): self.reader}.values():
            close = getattr(backend, "close", None)
            if close is not None:
                close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pages", type=int, default=32)
    parser.add_argument("--page-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="end with one JSON line of GB/s")
    args = parser.parse_args()
    geometry = (args.page_tokens, args.layers, args.heads, args.dim)
    src, dst = HostPool(args.pages, *geometry), HostPool(args.pages, *geometry)
    src.kv_buffer.copy_(torch.randn(src.kv_buffer.shape, generator=torch.Generator()))
    dst.kv_buffer.zero_()
    nbytes = src.kv_buffer.numel() * src.kv_buffer.element_size()
    gb = nbytes / 1e9

    seconds: dict[str, float] = {}

    def keep(key: str, value: float) -> None:
        seconds[key] = min(seconds.get(key, value), value)

    # numpy byte copies, region by region (torch's copy_ of bf16 slices is several times
    # slower here: not the memory bound)
    ptrs, sizes = src.get_page_buffer_meta(torch.arange(src.size))
    base = src.kv_buffer.data_ptr()
    src_bytes = src.kv_buffer.view(-1).view(torch.uint8).numpy()
    dst_bytes = dst.kv_buffer.view(-1).view(torch.uint8).numpy()
    regions = [(p - base, s) for p, s in zip(ptrs, sizes, strict=True)]

    def memcpy() -> None:
        for at, size in regions:
            np.copyto(dst_bytes[at : at + size], src_bytes[at : at + size])

    with tempfile.TemporaryDirectory() as tmp:
        # The node's CPU tier holds two rounds (as in bench.dataplane): once the warm-up has
        # filled it, every store reuses slots already faulted in (evicting the round before
        # last, never the one just read), as a node in service does.
        proc, url = start(Path(tmp) / "data", cpu_bytes=2 * nbytes)
        cases: dict[str, Case] = {}
        try:

            def ours(path: str, pool: HostPool) -> Any:
                extra = {
                    "backend_name": "sessioncache",
                    "module_path": "sessioncache.connector.sglang",
                    "class_name": "SessionCacheHiCacheStorage",
                    "url": url,
                    "path": path,
                    "interface_v1": True,
                }
                backend = StorageBackendFactory.create_backend(
                    "dynamic", storage_config(extra), None
                )
                assert isinstance(backend, SessionCacheHiCacheStorage)
                backend.register_mem_pool_host(pool)
                return backend

            for path in ("same_host", "stream"):
                cases[path] = Case(ours(path, src), ours(path, dst), src, dst, args.pages, True)
            files = StorageBackendFactory.create_backend(
                "file", storage_config({"file_storage_path": str(Path(tmp) / "hicache")}), None
            )
            cases["file"] = Case(files, files, src, dst, args.pages, v1=False)
            for case in cases.values():  # warm-up, not counted; checks the bytes
                case.store()
                case.check()
                case.store()  # fills the node's tier: later stores evict
                case.load()
            for _ in range(args.repeats):
                for _ in range(3):  # cheap, and the reference should be the machine's best
                    keep("memcpy", timed(memcpy))
                for name, case in cases.items():
                    keep(f"{name}_set", case.store())
                    keep(f"{name}_get", case.load())
        finally:
            for case in cases.values():
                case.close()
            proc.terminate()
            proc.wait(10)

    rate = {k: gb / v for k, v in seconds.items()}
    region = src.get_page_buffer_meta(torch.arange(src.page_size))[1][0]
    print(
        f"{args.pages} pages of {nbytes / args.pages / (1 << 20):g} MiB "
        f"(2 regions of {region / (1 << 20):g} MiB), {gb:.2f} GB per case, "
        f"best of {args.repeats}"
    )
    print(f"{'case':<36} {'GB/s':>6}  {'/ memcpy':>8}  {'/ file':>7}")
    names = [
        ("memcpy", "memcpy, pool to pool"),
        ("same_host_set", "sessioncache same-host batch_set_v1"),
        ("same_host_get", "sessioncache same-host batch_get_v1"),
        ("stream_set", "sessioncache stream batch_set_v1"),
        ("stream_get", "sessioncache stream batch_get_v1"),
        ("file_set", "SGLang HiCacheFile batch_set"),
        ("file_get", "SGLang HiCacheFile batch_get"),
    ]
    for key, label in names:
        file_ref = rate["file_set"] if key.endswith("set") else rate["file_get"]
        vs_file = f"{rate[key] / file_ref:7.2f}" if key != "memcpy" else f"{'':>7}"
        print(f"{label:<36} {rate[key]:6.2f}  {rate[key] / rate['memcpy']:8.1%}  {vs_file}")
    if args.json:
        print(json.dumps({k: round(v, 3) for k, v in sorted(rate.items())}))


if __name__ == "__main__":
    main()
