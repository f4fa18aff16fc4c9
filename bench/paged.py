"""Loads and saves of an engine's paged KV cache through the node a user starts (README
defaults, disk tier on), as ``SessionCacheConnector`` makes them, beside a memcpy of the same
blocks measured in the same run.

The cache is laid out as vLLM's CPU backend lays it (``LBHNC``: one allocation, each layer
``[blocks, kv_heads, block_tokens, 2 * head_dim]``), shaped as SmolLM2-135M's (30 layers, 3 KV
heads of 64, bf16: 720 KiB per 32-token block, 30 runs of 24 KiB per block). Per round, an
engine saves ``--blocks`` new blocks of one chain (``EngineNode.save``: gathered straight into
the node's staging memory on the same host) and another engine loads them into other blocks
of its own cache (``EngineNode.load``: one lease, copied straight out of the node's shared
memory). Saves come first, all rounds; then one load of each chain, which maps the node's
segments into the engine (once per segment in an engine's life: printed apart); then the
timed loads, after the node's write-behind queue drained (an engine's loads meet blocks stored
earlier). The timings are the connector's calls, end to end: hashing the tokens, the lookup,
the lease, the copies, the release (for a save: the node's own copy and checksum of the staged
blocks, until it answers).

References, same process, same blocks: ``memcpy``, numpy copies of whole 720 KiB blocks
between two arrays (faulted in); ``runs``, the same bytes copied run by run between two paged
caches (the copies a load cannot avoid: the floor of the layout, no node). Printed: best and
median GB/s of each and the ratio to memcpy; ``--path stream`` measures the TCP stream
instead, labelled.

Run: ``python -m bench.paged [--blocks 64 192] [--rounds 7] [--path same_host|stream]``.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import torch

from bench.lookup import start
from sessioncache.connector.paged import (
    COPY_THREADS,
    EngineNode,
    NodeSettings,
    PagedLayout,
    Transfer,
)
from sessioncache.hashing import Namespace

LAYERS, HEADS, HEAD_DIM, BLOCK_TOKENS = 30, 3, 64, 32
NS = Namespace("bench-paged-smollm2", BLOCK_TOKENS, "bfloat16", "vllm-paged/cpu/l30/h3x64/tp1.0")


def paged_cache(num_blocks: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    buf = torch.empty(LAYERS, num_blocks, HEADS, BLOCK_TOKENS, 2 * HEAD_DIM, dtype=torch.bfloat16)
    buf.view(torch.int16).random_(generator=g)
    return {f"model.layers.{i}.self_attn": buf[i] for i in range(LAYERS)}


def rates(nbytes: int, seconds: list[float]) -> tuple[float, float]:
    """Best and median GB/s."""
    return nbytes / min(seconds) / 1e9, nbytes / statistics.median(seconds) / 1e9


def timed(fn: Callable[[], object], rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def settle(url: str) -> None:
    """Wait until the node's write-behind queue is empty (its disk copies made)."""
    for _ in range(600):
        text = httpx.get(f"{url}/metrics").text
        queued = sum(  # per tenant; none when the queue is empty
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("sessioncache_write_behind_bytes{")
        )
        if not queued:
            return
        time.sleep(0.1)


def measure(
    url: str,
    n: int,
    layouts: tuple[PagedLayout, PagedLayout, PagedLayout],
    nodes: tuple[EngineNode, EngineNode],
    rounds: int,
    rng: np.random.Generator,
) -> dict[str, list[float]]:
    """Seconds per round of each copy of ``n`` blocks."""
    layout_a, layout_b, layout_b1 = layouts
    saver, loader = nodes
    size = layout_a.nbytes
    src_ids = list(range(0, 2 * n, 2))  # every other block: not one run of the cache
    dst_ids = list(range(1, 2 * n + 1, 2))
    # references
    blocks = np.empty((n, size), np.uint8)
    blocks.fill(1)
    copies = np.empty((n, size), np.uint8)
    copies.fill(2)

    def copy_blocks() -> None:
        for i in range(n):
            np.copyto(copies[i], blocks[i])

    memcpy = timed(copy_blocks, 11)
    plan_a = [(r.base, r.stride, r.length) for r in layout_a.runs]
    plan_b = [(r.base, r.stride, r.length) for r in layout_b.runs]

    def runs() -> None:
        for s, d in zip(src_ids, dst_ids, strict=True):
            for (sa, ss, length), (da, ds, _) in zip(plan_a, plan_b, strict=True):
                ctypes.memmove(da + d * ds, sa + s * ss, length)

    floor = timed(runs, 11)
    # the connector's calls
    saves: list[float] = []
    loads: list[float] = []
    loads1: list[float] = []
    prompts = [[int(t) for t in rng.integers(3, 49_000, n * BLOCK_TOKENS)] for _ in range(rounds)]
    for r, tokens in enumerate(prompts):
        t0 = time.perf_counter()
        held = saver.save(NS, Transfer(f"s{r}", tokens, 0, src_ids), layout_a)
        saves.append(time.perf_counter() - t0)
        assert held == n, held
    firsts = []
    for r, tokens in enumerate(prompts):
        t0 = time.perf_counter()
        assert loader.load(NS, Transfer(f"f{r}", tokens, 0, dst_ids), layout_b1).blocks == n
        firsts.append(time.perf_counter() - t0)
    settle(url)  # loads meet an idle node, as an engine's loads of blocks stored earlier do
    for r, tokens in enumerate(prompts):
        order = [(layout_b, loads), (layout_b1, loads1)]
        for layout, into in order if r % 2 else order[::-1]:  # each goes first every other round
            t0 = time.perf_counter()
            got = loader.load(NS, Transfer(f"l{r}", tokens, 0, dst_ids), layout)
            into.append(time.perf_counter() - t0)
            assert got.blocks == n, got
    probe = np.empty((2, size), np.uint8)
    layout_a.gather([src_ids[-1]], [probe[0]])
    layout_b.gather([dst_ids[-1]], [probe[1]])
    assert (probe[0] == probe[1]).all(), "a loaded block differs from the saved one"
    return {
        "memcpy (reference)": memcpy,
        "runs, no node (floor)": floor,
        f"load, {layout_b.copy_threads} copy threads": loads,
        "load, 1 copy thread": loads1,
        "load, segments unmapped": firsts,
        "save": saves,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[64, 192])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--path", choices=["same_host", "stream"], default="same_host")
    parser.add_argument("--copy-threads", type=int, default=COPY_THREADS)  # on two cores
    parser.add_argument(
        "--stripped", action="store_true", help="a node without its disk tier (labelled)"
    )
    args = parser.parse_args()
    most = max(args.blocks)
    num_blocks = 2 * most + 8
    cache_a, cache_b = paged_cache(num_blocks, 1), paged_cache(num_blocks, 2)
    layout_a = PagedLayout(cache_a, num_blocks)
    layout_b = PagedLayout(cache_b, num_blocks, copy_threads=args.copy_threads)
    layout_b1 = PagedLayout(cache_b, num_blocks, copy_threads=1)
    size = layout_a.nbytes
    rng = np.random.default_rng(0)
    work = Path(tempfile.mkdtemp(prefix="bench-paged-"))
    proc, url = start(
        work / "node",
        cpu_bytes=4 << 30,
        extra_env={"SESSIONCACHE_DISK_BYTES": "0" if args.stripped else str(64 << 30)},
    )
    label = "STRIPPED (no disk tier)" if args.stripped else "README defaults (disk tier on)"
    print(
        f"node: {label}, path {args.path}; block {size // 1024} KiB "
        f"({LAYERS} runs of {size // LAYERS // 1024} KiB); {args.rounds} rounds"
    )
    print(
        f"{'blocks':>6} {'what':<22} {'best GB/s':>9} {'median':>7} "
        f"{'best/memcpy':>11} {'median/memcpy':>13}"
    )
    try:
        saver = EngineNode(NodeSettings(url, data_path=args.path))
        loader = EngineNode(NodeSettings(url, data_path=args.path))
        for n in args.blocks:
            layouts = (layout_a, layout_b, layout_b1)
            found = measure(url, n, layouts, (saver, loader), args.rounds, rng)
            ref_best, ref_median = rates(n * size, found["memcpy (reference)"])
            for what, seconds in found.items():
                best, median = rates(n * size, seconds)
                print(
                    f"{n:>6} {what:<24} {best:9.2f} {median:7.2f} "
                    f"{best / ref_best:11.2f} {median / ref_median:13.2f}"
                )
        saver.close()
        loader.close()
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
