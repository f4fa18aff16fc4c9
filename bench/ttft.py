"""Time to first token of an agent session, end to end: a Llama-architecture model (random
weights from a config, float32, nothing downloaded) run by ``CachedPrefixRunner`` with a
``KVTransfer`` against a real ``sessioncache serve``, cold and with the prefix from the node.

The session: an ``--prefix-tokens`` prefix (system prompt, tool definitions, documents), then
``--turns`` turns; each turn appends ``--turn-tokens`` new tokens (the last answer plus the next
user message or tool output: a few hundred, as an agent's turns are) and asks for the next token.
Turn 0 (prefix and the first message) is prefilled cold once and saved; each measured turn
loads the longest cached prefix of its prompt (the previous turn's full blocks), prefills the
rest (the new tokens, and the tail of the previous prompt that did not fill a block) and saves
its own full blocks, as an engine would after the turn. The answer tokens are part of the next
turn's new tokens rather than decoded here: only the first token's latency is measured.

Cases, each in its own namespace (so that each loads what it stored):

- cold:       the model over the whole prompt (no cache): the reference TTFT and logits
- same_host:  the prefix from the node's CPU tier through shared memory (``SameHostClient``)
- stream:     the prefix from the node's CPU tier over the binary TCP stream (the remote path;
              loopback here)
- disk:       the node restarted between turns (its CPU tier starts empty), so the prefix is
              read back from the disk tier (promoted by LOCATE), then over shared memory; the
              files were just written, so the kernel's page cache likely holds them

TTFT is the wall time of ``runner.prefill(prompt, session_id=..., last_logits_only=True)``: the
block ids, the session's lookup on the control plane, the transfer, the rebuild of the
transformers cache and the forward pass over the uncached tokens. Each turn's next-token logits
are compared with the cold run's (max abs diff). Load bandwidth: KV bytes over the transfer's
seconds, and over the whole load (transfer plus cache rebuild), printed beside the break-even of
a real GPU (an H100 prefills Llama-3.1-8B at ~12K tokens/s and 128 KiB of KV per token, i.e.
produces KV at ~1.6 GB/s: a load slower than that loses to recomputing there) and this CPU's own
(the KV bytes of a prompt over its cold prefill time).

Run: ``python -m bench.ttft [--prefix-tokens 8192] [--turn-tokens 256] [--turns 4]
[--block-tokens 64] [--layers 4] [--hidden 1024] [--json]``; ``--json`` adds one JSON object as
the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
import transformers

from bench import compare
from bench.lookup import free_port
from sessioncache.connector import SessionCacheClient
from sessioncache.connector.transfer import KVTransfer
from sessioncache.connector.transformers import (
    CachedPrefixRunner,
    KVShape,
    model_forward,
    namespace_for,
)

TARGET = 10.0
"""Cold TTFT over TTFT with the prefix from the CPU tier (same host)."""
TOLERANCE = 1e-4
H100_KV_GBPS = 12_000 * 32 * 2 * 8 * 128 * 2 / 1e9
"""Llama-3.1-8B: 32 layers x (K, V) x 8 KV heads x 128 dims x bf16 per token, at 12K tokens/s."""
PATHS = ("same_host", "stream", "disk")


def build_model(args: argparse.Namespace) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or int(args.hidden * 3.5),
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // args.head_dim,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=max(8192, args.prefix_tokens + (args.turns + 1) * args.turn_tokens),
    )
    return transformers.LlamaForCausalLM(config).to(torch.float32).eval()


class Node:
    """A ``sessioncache serve`` with a CPU and a disk tier over one data dir, restartable."""

    def __init__(
        self, data_dir: Path, cpu_bytes: int, disk_bytes: int, *, durable: bool = True
    ) -> None:
        """``durable``: every store answered once on disk (what a restarted node reads back);
        else the README's default, written behind."""
        self.data_dir = data_dir
        self.env = {
            **os.environ,
            "SESSIONCACHE_CPU_BYTES": str(cpu_bytes),
            "SESSIONCACHE_DISK_BYTES": str(disk_bytes),
            "SESSIONCACHE_DURABLE_UPLOADS": "true" if durable else "false",
            "SESSIONCACHE_STREAM_PORT": "0",
            "SESSIONCACHE_MAX_BODY_BYTES": str(256 << 20),
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.start()

    def start(self) -> None:
        port = free_port()
        log = (self.data_dir.parent / f"serve-{port}.log").open("wb")
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "sessioncache.cli", "serve"),
                *("--port", str(port), "--data-dir", str(self.data_dir)),
            ],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the node exited {self.proc.returncode} (log {log.name})")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("the node did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@dataclass
class Turn:
    """One measured turn of one case."""

    ttft: float
    cached: int
    computed: int
    load: float = 0.0
    compute: float = 0.0
    transfer: float = 0.0
    nbytes: int = 0
    diff: float = 0.0


class Case:
    """One case's agent session: a client, a transfer and a runner over its own namespace,
    against its node (``disk`` restarts its node before every turn)."""

    def __init__(self, name: str, model: Any, node: Node, block_tokens: int) -> None:
        self.name, self.model, self.node, self.block_tokens = name, model, node, block_tokens
        self.path = "stream" if name == "stream" else "same_host"
        self.turns: list[Turn] = []
        self._connect()
        self.sid = self.client.open_session(f"agent-{name}", kind="agent", ttl_s=3600).id

    def _connect(self) -> None:
        ns = namespace_for(
            self.model, block_tokens=self.block_tokens, model_id=f"bench/ttft-{self.name}"
        )
        self.client = SessionCacheClient(self.node.url, namespace=ns, timeout=300)
        self.transfer = KVTransfer(self.client, path=self.path)  # type: ignore[arg-type]
        self.runner = CachedPrefixRunner(self.model, self.client, transfer=self.transfer)

    def seed(self, prompt: np.ndarray, cache: Any) -> None:
        """Turn 0, prefilled cold elsewhere: its blocks stored as the engine would."""
        self.runner.save(prompt, cache, session_id=self.sid)

    def turn(self, prompt: np.ndarray, reference: torch.Tensor) -> Turn:
        if self.name == "disk":  # the CPU tier starts empty: the blocks come from disk
            self.close()
            self.node.restart()
            self._connect()
        runner = self.runner
        t0 = time.perf_counter()
        pre = runner.prefill(prompt, session_id=self.sid, last_logits_only=True)
        ttft = time.perf_counter() - t0
        got = runner.last_load
        if got is None or got.path != self.path:
            raise RuntimeError(f"{self.name}: the load went over {got and got.path}")
        turn = Turn(
            ttft,
            pre.cached_tokens,
            pre.computed_tokens,
            pre.timings.get("load", 0.0),
            pre.timings.get("compute", 0.0),
            got.seconds,
            got.nbytes,
            (pre.logits[0, -1] - reference).abs().max().item(),
        )
        self.turns.append(turn)
        runner.save(prompt, pre.cache, session_id=self.sid)  # after the turn, not timed
        return turn

    def close(self) -> None:
        self.transfer.close()
        self.client.close()


def cold_prefill(model: Any, prompt: np.ndarray) -> tuple[float, torch.Tensor, Any]:
    """The whole prompt through the model: seconds, next-token logits, cache."""
    t0 = time.perf_counter()
    logits, cache = model_forward(model, torch.from_numpy(prompt)[None], last_logits_only=True)
    return time.perf_counter() - t0, logits[0, -1].clone(), cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prefix-tokens", type=int, default=8192)
    parser.add_argument("--turn-tokens", type=int, default=256)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=0, help="default 3.5 x hidden")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--cases", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    compare.add_arguments(parser)
    args = parser.parse_args()
    if compare.run_if_asked(
        args, "bench.ttft", lower_is_better=lambda key: key.endswith("_s") or "diff" in key
    ):
        return

    model = build_model(args)
    shape = KVShape.of(model)
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, args.vocab, args.prefix_tokens, dtype=np.int64)
    segments = [
        rng.integers(0, args.vocab, args.turn_tokens, dtype=np.int64) for _ in range(args.turns + 1)
    ]
    prompts = [np.concatenate([prefix, *segments[: t + 1]]) for t in range(args.turns + 1)]
    params = sum(p.numel() for p in model.parameters())
    kv_per_token = shape.block_bytes(1, torch.float32)
    print(
        f"model: Llama, {params / 1e6:.0f}M parameters (random), {shape.num_layers} layers, "
        f"{shape.num_kv_heads} KV heads x {shape.head_dim}, float32, "
        f"{kv_per_token / 1024:g} KiB of KV per token; torch threads {torch.get_num_threads()}"
    )
    print(
        f"session: {args.prefix_tokens}-token prefix, {args.turns} turns of "
        f"{args.turn_tokens} new tokens, blocks of {args.block_tokens} tokens"
    )

    # Turn 0 prefilled cold seeds every case; then, turn by turn, the cold prefill and each
    # case take turns, so that load from elsewhere on this machine hits them alike.
    kv_total = kv_per_token * len(prompts[-1]) * (len(args.cases) + 1)
    cold: list[float] = [0.0]
    with tempfile.TemporaryDirectory(prefix="bench-ttft-") as tmp:
        nodes: list[Node] = []
        cases: dict[str, Case] = {}
        try:
            node = Node(Path(tmp) / "data", cpu_bytes=2 * kv_total, disk_bytes=4 * kv_total)
            nodes.append(node)
            for name in args.cases:
                if name == "disk":  # a node of its own, restarted before every turn
                    node = Node(Path(tmp) / "disk", 2 * kv_total, disk_bytes=4 * kv_total)
                    nodes.append(node)
                cases[name] = Case(name, model, node, args.block_tokens)
            _, _, seed_cache = cold_prefill(model, prompts[0])
            for case in cases.values():
                case.seed(prompts[0], seed_cache)
            del seed_cache
            for t in range(1, len(prompts)):
                seconds, reference, _ = cold_prefill(model, prompts[t])
                cold.append(seconds)
                for case in cases.values():
                    case.turn(prompts[t], reference)
        finally:
            for case in cases.values():
                case.close()
            for node in nodes:
                node.stop()
    results = {name: case.turns for name, case in cases.items()}

    print()
    print(
        f"{'turn':>4} {'case':<10} {'prompt':>6} {'cached':>6} {'new':>5} {'TTFT s':>8} "
        f"{'load s':>7} {'xfer GB/s':>9} {'load GB/s':>9} {'compute s':>9} {'speedup':>8} "
        f"{'max|dlogit|':>11}"
    )
    for t in range(1, len(prompts)):
        n = len(prompts[t])
        print(
            f"{t:>4} {'cold':<10} {n:>6} {0:>6} {n:>5} {cold[t]:>8.3f} {'':>7} {'':>9} "
            f"{'':>9} {cold[t]:>9.3f} {1:>7.1f}x {0:>11.2e}"
        )
        for case in args.cases:
            r = results[case][t - 1]
            xfer = r.nbytes / r.transfer / 1e9 if r.transfer else 0.0
            load = r.nbytes / r.load / 1e9 if r.load else 0.0
            print(
                f"{'':>4} {case:<10} {n:>6} {r.cached:>6} {r.computed:>5} {r.ttft:>8.3f} "
                f"{r.load:>7.3f} {xfer:>9.2f} {load:>9.2f} {r.compute:>9.3f} "
                f"{cold[t] / r.ttft:>7.1f}x {r.diff:>11.2e}"
            )

    cpu_kv_gbps = statistics.median(
        kv_per_token * len(prompts[t]) / cold[t] / 1e9 for t in range(1, len(prompts))
    )
    print()
    print(
        f"break-even KV load bandwidth: H100 prefilling Llama-3.1-8B {H100_KV_GBPS:.2f} GB/s; "
        f"this CPU prefilling this model {cpu_kv_gbps * 1000:.1f} MB/s"
    )
    summary: dict[str, Any] = {"cold_ttft_s": round(statistics.median(cold[1:]), 4)}
    worst_diff = 0.0
    for case in args.cases:
        rows = results[case]
        speedup = statistics.median(cold[i + 1] / r.ttft for i, r in enumerate(rows))
        xfer = statistics.median(r.nbytes / r.transfer / 1e9 for r in rows if r.transfer)
        load = statistics.median(r.nbytes / r.load / 1e9 for r in rows if r.load)
        diff = max(r.diff for r in rows)
        worst_diff = max(worst_diff, diff)
        print(
            f"{case:<10} median TTFT {statistics.median(r.ttft for r in rows):.3f} s, "
            f"{speedup:.1f}x lower than cold; KV load {xfer:.2f} GB/s transfer, {load:.2f} GB/s "
            f"with the cache rebuild = {load / H100_KV_GBPS:.1f}x the H100 break-even; "
            f"max |dlogit| {diff:.2e}"
        )
        summary[case] = {
            "ttft_s": round(statistics.median(r.ttft for r in rows), 4),
            "speedup": round(speedup, 2),
            "transfer_gbps": round(xfer, 3),
            "load_gbps": round(load, 3),
            "max_abs_diff": diff,
        }
    if "same_host" in results:
        worst = min(cold[i + 1] / r.ttft for i, r in enumerate(results["same_host"]))
        verdict = "met" if worst >= TARGET else "missed"
        print(
            f"target: TTFT from the CPU tier >= {TARGET:g}x lower: {verdict} "
            f"(worst turn {worst:.1f}x)"
        )
    verdict = "met" if worst_diff <= TOLERANCE else "missed"
    print(f"target: next-token logits max abs diff <= {TOLERANCE:g}: {verdict} ({worst_diff:.2e})")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
