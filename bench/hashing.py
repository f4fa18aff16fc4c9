"""Block-id hashing speed: ms per prompt for 8K / 32K / 128K tokens at block sizes 16, 64, 256.

Each figure is printed beside one single-pass XXH3-128 over the same token bytes (the floor of
any hashing scheme: the bytes must be read once) and, when ``lmcache`` is importable, LMCache's
own token database on the same prompt. Run: ``python -m bench.hashing [--repeat 50]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import xxhash

from sessioncache.hashing import Namespace, block_hashes

PROMPTS = [8192, 32768, 131072]
BLOCKS = [16, 64, 256]


def best_ms(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(best, median) wall time in ms over ``repeat`` runs."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times), statistics.median(times)


def lmcache_hasher(block_tokens: int) -> Callable[[np.ndarray], object] | None:
    """LMCache's own chunked token database (its prefix-hash chain), when importable."""
    try:
        import torch
        from lmcache.v1.token_database import ChunkedTokenDatabase  # type: ignore[import-not-found]
    except Exception:
        return None
    db = ChunkedTokenDatabase(None, None)
    db.chunk_size = block_tokens

    def run(tokens: np.ndarray) -> object:
        return list(db.process_tokens(torch.from_numpy(tokens.astype(np.int64)), make_key=False))

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(
        f"{'tokens':>7} {'block':>5} {'blocks':>6} {'ours best':>10} {'median':>8} "
        f"{'1-pass xxh3':>11} {'ratio':>6} {'lmcache':>8}"
    )
    for n in PROMPTS:
        tokens = rng.integers(0, 128_000, n, dtype=np.uint32)
        raw = tokens.astype("<u4").tobytes()
        floor, _ = best_ms(lambda raw=raw: xxhash.xxh3_128_digest(raw), args.repeat)
        for bt in BLOCKS:
            ns = Namespace("bench-model", bt, "bfloat16", "bench-layout")
            ours, median = best_ms(lambda ns=ns, t=tokens: block_hashes(ns, t), args.repeat)
            peer = lmcache_hasher(bt)
            peer_ms = (
                f"{best_ms(lambda t=tokens, p=peer: p(t), args.repeat)[0]:8.3f}"
                if peer is not None
                else "     n/a"
            )
            print(
                f"{n:>7} {bt:>5} {n // bt:>6} {ours:10.3f} {median:8.3f} "
                f"{floor:11.3f} {ours / floor:6.1f} {peer_ms}"
            )
    print("ms per prompt; ratio = ours / one single-pass xxh3-128 over the same bytes")


if __name__ == "__main__":
    main()
