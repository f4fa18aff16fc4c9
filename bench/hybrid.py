"""Hybrid models through the node a user starts (README defaults, disk tier on): bytes stored
per cached token and time to first token with and without the cache, for a Gemma 3 layout
(sliding windows), a Qwen3-Next layout (Gated DeltaNet states) and, as the reference measured
in the same run, a Llama of the same width and depth (every layer full attention).

Each model is a random-weight transformers model (``HybridRunner``, bf16, on this host's CPU):
engine A computes the prompt cold and stores it (the spine's blocks, and the checkpoints'
window or state objects at the stride and the prompt's end); engine B, another runner with its
own connection, resumes the same prompt from the node. Printed per model: bytes stored, bytes
per cached token and their ratio to the Llama's; the bytes a resume reads per cached token;
cold and cached TTFT (median of ``--repeats``) and their ratio.

Run: ``python -m bench.hybrid [--tokens 4096] [--layers 12] [--stride 32] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.lookup import start
from sessioncache.connector.hybrid import DEFAULT_CHECKPOINT_BLOCKS
from sessioncache.connector.paged import EngineNode, NodeSettings
from sessioncache.connector.transformers_hybrid import HybridRunner

BLOCK = 32


def configs(layers: int, hidden: int, window: int) -> dict[str, dict[str, Any]]:
    common = {
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 1024,
        "max_position_embeddings": 65536,
    }
    return {
        "llama (reference)": {"model_type": "llama", **common},
        "gemma3 (5 window : 1 full)": {
            "model_type": "gemma3_text",
            **common,
            "sliding_window": window,
            "layer_types": [
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)
            ],
            "query_pre_attn_scalar": 64,
        },
        "qwen3-next (3 linear : 1 full)": {
            "model_type": "qwen3_next",
            **common,
            "layer_types": [
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
            ],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_conv_kernel_dim": 4,
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": hidden,
            "shared_expert_intermediate_size": hidden,
        },
    }


def model_of(config: dict[str, Any]) -> Any:
    fields = {k: v for k, v in config.items() if k != "model_type"}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(config["model_type"], **fields), dtype=torch.bfloat16
    ).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.fill_(math.log(0.01))
    return model


def measure(
    name: str, config: dict[str, Any], url: str, prompt: list[int], stride: int, repeats: int
) -> dict[str, float]:
    model = model_of(config)
    node_a = EngineNode(NodeSettings(url))
    node_b = EngineNode(NodeSettings(url))
    try:
        settings = {"model_id": f"bench-hybrid/{name}", "block_tokens": BLOCK}
        a = HybridRunner(model, node_a, checkpoint_blocks=stride, **settings)  # type: ignore[arg-type]
        cold = []
        first = None
        for i in range(repeats):  # salted apart: each run is cold
            runner = HybridRunner(
                model,
                node_a,
                checkpoint_blocks=stride,
                salt=f"cold-{i}",
                **settings,  # type: ignore[arg-type]
            )
            start = time.perf_counter()
            runner.prefill(prompt)
            cold.append(time.perf_counter() - start)
        first = a.prefill(prompt)
        a.save(prompt, first)
        full = len(prompt) // BLOCK
        spine = full * a.spine_bytes
        objects = sum(int(p.nbytes) for c in first.checkpoints for p in c.payloads)
        b = HybridRunner(model, node_b, checkpoint_blocks=stride, **settings)  # type: ignore[arg-type]
        warm = []
        cached = 0
        for _ in range(repeats):
            start = time.perf_counter()
            got = b.prefill(prompt)
            warm.append(time.perf_counter() - start)
            cached = got.cached_tokens
        end = cached // BLOCK
        read = end * a.spine_bytes + sum(
            (len(spec.needed(0, end)) if spec.kind == "window" else 1) * nbytes
            for spec, nbytes in zip(a.hybrid.companions, a.companion_bytes, strict=True)
        )
        return {
            "stored_bytes": float(spine + objects),
            "stored_per_token": (spine + objects) / (full * BLOCK),
            "read_per_token": read / max(cached, 1),
            "cached_tokens": float(cached),
            "cold_ttft_s": statistics.median(cold),
            "cached_ttft_s": statistics.median(warm),
        }
    finally:
        node_a.close()
        node_b.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--stride", type=int, default=DEFAULT_CHECKPOINT_BLOCKS, help="in blocks")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    prompt = [
        int(t)
        for t in torch.randint(3, 1000, (args.tokens,), generator=torch.Generator().manual_seed(1))
    ]
    work = Path(tempfile.mkdtemp(prefix="bench-hybrid-"))
    proc, url = start(
        work / "node", cpu_bytes=4 << 30, extra_env={"SESSIONCACHE_DISK_BYTES": str(64 << 30)}
    )
    print(
        f"node: README defaults (disk tier on); {args.tokens}-token prompt, {args.layers} layers, "
        f"hidden {args.hidden}, window {args.window}, {BLOCK}-token blocks, checkpoints every "
        f"{args.stride} blocks and at the prompt's end; bf16 on CPU"
    )
    results: dict[str, dict[str, float]] = {}
    try:
        for name, config in configs(args.layers, args.hidden, args.window).items():
            results[name] = measure(name, config, url, prompt, args.stride, args.repeats)
    finally:
        proc.kill()
        proc.wait()
    ref = results["llama (reference)"]
    print(
        f"{'model':<31} {'stored MiB':>10} {'B/token':>8} {'/llama':>6} {'read B/tok':>10} "
        f"{'cached':>6} {'cold s':>7} {'cached s':>8} {'speedup':>7}"
    )
    for name, r in results.items():
        print(
            f"{name:<31} {r['stored_bytes'] / 2**20:>10.2f} {r['stored_per_token']:>8.0f} "
            f"{r['stored_per_token'] / ref['stored_per_token']:>6.3f} {r['read_per_token']:>10.0f} "
            f"{int(r['cached_tokens']):>6} {r['cold_ttft_s']:>7.3f} {r['cached_ttft_s']:>8.3f} "
            f"{r['cold_ttft_s'] / r['cached_ttft_s']:>7.2f}"
        )
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
