"""Agent sessions through vLLM with each KV cache a platform team can choose, by configuration
alone: no connector, ``SessionCacheConnector`` (a node on README's defaults),
``OffloadingConnector`` with its CPU tier and with its CPU and filesystem tiers
(``TieringOffloadingSpec``, ``secondary_tiers: [{"type": "fs"}]``), and LMCache
(``LMCacheConnectorV1``, its configuration from ``LMCACHE_*`` variables).

The sessions are the first ``--sessions`` of ``--trace`` (``../shared/traces/
agent-sessions-more/``), their first four requests each (their own, not their subagents'). A
request's prompt is its ``hash_ids``: each trace block (64 tokens) becomes
``64 x --length-scale`` token ids derived from the session and the id, so equal prefixes stay
equal and sessions do not share by accident; prompts are cut to ``--max-tokens``. Before each
request the engine waits the trace's think time x ``--think-scale``. Per configuration,
three engine processes in turn:

- engine A serves each session's request 1 (``first``) and request 2 (``same engine``);
- engine B, a second process, serves request 3 (``other engine``);
- engine A again, restarted (a new process, the same configuration), serves request 4
  (``after restart``).

Printed per configuration and turn class: TTFT p50/p90 (offline, one output token), the
share of prompt tokens vLLM did not prefill (its ``num_cached_tokens``), and for
``sessioncache`` the node's payload bytes per turn (received + loaded). Configurations that
cannot run here are printed with why: ``OffloadingConnector``'s worker asserts CUDA or XPU
tensors (``vllm/v1/kv_offload/cpu/gpu_worker.py``) and LMCache's connector needs its CUDA
ops, so on a host without a GPU only ``none`` and ``sessioncache`` run.

Run on a GPU host with vLLM (CUDA) and LMCache installed in one environment:
``python -m bench.peers_vllm --vllm-python PY --model meta-llama/Llama-3.1-8B-Instruct
--block-size 16 --length-scale 1 --max-tokens 32000 --think-scale 0.01 --sessions 16``; on
this machine (vLLM's CPU build, ``.venv-vllm``) it converts SmolLM2-135M-Instruct as
``bench.vllm`` does: ``python -m bench.peers_vllm`` (its defaults are sized for 2 CPU cores:
2 sessions, lengths x 0.05, cut at 512 tokens). ``--configs`` picks configurations.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "agent-sessions-more"
CONFIGS = ("none", "sessioncache", "offload-cpu", "offload-fs", "lmcache")
CLASSES = ("first", "same engine", "other engine", "after restart")
ENGINES = ((0, 1), (2,), (3,))
"""Per engine process, the indexes of the requests of each session it serves."""
TRACE_BLOCK = 64
GPU_ONLY = {
    "offload-cpu": "OffloadingConnector's worker asserts CUDA or XPU tensors "
    "(vllm/v1/kv_offload/cpu/gpu_worker.py)",
    "offload-fs": "the fs tier sits under OffloadingConnector's CPU tier, whose worker asserts "
    "CUDA or XPU tensors (vllm/v1/kv_offload/cpu/gpu_worker.py)",
    "lmcache": "LMCacheConnectorV1 moves KV with LMCache's CUDA ops",
}


def session_prompts(
    path: Path, index: int, scale: float, max_tokens: int, vocab: int
) -> list[tuple[list[int], float]]:
    """The first four requests of one trace session: token ids and think seconds before."""
    trace = json.loads(path.read_text())
    per_block = max(1, round(TRACE_BLOCK * scale))
    out = []
    own = [r for r in trace["requests"] if "hash_ids" in r]  # not its subagents' entries
    for request in own[: len(CLASSES)]:
        tokens: list[int] = []
        for block in request["hash_ids"]:
            seed = hashlib.blake2b(f"{index}/{block}".encode(), digest_size=8).digest()
            state = int.from_bytes(seed, "little")
            for _ in range(per_block):
                state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
                tokens.append(100 + (state >> 33) % (vocab - 200))
        out.append((tokens[:max_tokens], float(request.get("think_time", 0.0))))
    if len(out) < len(CLASSES):
        raise ValueError(f"{path.name}: fewer than {len(CLASSES)} requests")
    return out


def transfer_config(config: str, url: str | None, work: Path, cpu_bytes: int) -> Any:
    """``kv_transfer_config`` of ``config`` as its documentation writes it (JSON-able)."""
    if config == "none":
        return None
    if config == "sessioncache":
        return {
            "kv_connector": "SessionCacheConnector",
            "kv_connector_module_path": "sessioncache.connector.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"url": url},
            "kv_load_failure_policy": "recompute",
        }
    if config in ("offload-cpu", "offload-fs"):
        extra: dict[str, Any] = {"cpu_bytes_to_use": cpu_bytes}
        if config == "offload-fs":
            extra["spec_name"] = "TieringOffloadingSpec"
            extra["secondary_tiers"] = [{"type": "fs", "root_dir": str(work / "vllm-fs")}]
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    return {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}


def engine_main(spec: dict[str, Any]) -> None:
    """One engine process (vLLM's environment): each prompt after its wait, one output token,
    its seconds and cached tokens as ``RESULT`` lines."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    given = spec["transfer"]
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        block_size=spec["block_size"],
        max_model_len=spec["max_model_len"],
        enable_prefix_caching=True,
        kv_transfer_config=KVTransferConfig(**given) if given else None,
        enforce_eager=spec["eager"],
        seed=0,
        dtype="bfloat16",
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([TokensPrompt(prompt_token_ids=spec["warmup"])], params, use_tqdm=False)
    for tokens, wait_s in spec["prompts"]:
        time.sleep(wait_s)
        start = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        result = {"seconds": seconds, "cached": out.num_cached_tokens, "tokens": len(tokens)}
        print("RESULT " + json.dumps(result), flush=True)
    time.sleep(spec.get("linger_s", 0))  # the last saves finish before the engine ends


def run_engine(
    python: Path, spec: dict[str, Any], env: dict[str, str], work: Path
) -> list[dict[str, Any]]:
    path = work / "engine.json"  # prompts past what one argument may hold
    path.write_text(json.dumps(spec))
    run = subprocess.run(
        [str(python), "-m", "bench.peers_vllm", "--engine", str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    found = [json.loads(line[7:]) for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode or len(found) != len(spec["prompts"]):
        lines = (run.stdout + run.stderr).strip().splitlines()
        raise RuntimeError("engine failed: " + (lines[-1] if lines else f"exit {run.returncode}"))
    return found


def node_bytes(url: str) -> float:
    """The node's payload bytes so far: received from engines plus loaded by them."""
    import httpx

    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(("sessioncache_received_payload_bytes_total", "sessioncache_loaded_b")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run_config(
    config: str,
    args: argparse.Namespace,
    python: Path,
    model: str,
    sessions: list[list[tuple[list[int], float]]],
    work: Path,
) -> dict[str, Any]:
    """Three engine processes (``ENGINES``) of one configuration; per turn class the results."""
    from bench.lookup import start

    proc = None
    url = None
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0"}  # one hash seed
    if config == "sessioncache":
        node_env = {"SESSIONCACHE_DISK_BYTES": str(64 << 30)}  # README's node
        proc, url = start(work / "node", cpu_bytes=args.node_cpu_gib << 30, extra_env=node_env)
    transfer = transfer_config(config, url, work, args.offload_cpu_gib << 30)
    by_class: dict[str, list[dict[str, Any]]] = {c: [] for c in CLASSES}
    try:
        before = node_bytes(url) if url else 0.0
        for served in ENGINES:
            warm = random.Random(os.urandom(8))
            prompts = [(s[i][0], s[i][1] * args.think_scale) for s in sessions for i in served]
            spec = {
                "model": model,
                "block_size": args.block_size,
                "max_model_len": args.max_tokens + 64,
                "eager": args.eager,
                "transfer": transfer,
                # as long as the longest prompt, and of its own per engine: its first long
                # prefill is not timed, and no engine hits what another's warm-up stored
                "warmup": [warm.randrange(100, args.vocab - 100) for _ in range(args.max_tokens)],
                "prompts": prompts,
                "linger_s": 3 if transfer else 0,
            }
            results = iter(run_engine(python, spec, env, work))
            for _ in sessions:
                for i in served:
                    by_class[CLASSES[i]].append(next(results))
        moved = (node_bytes(url) - before) if url else None
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    turns = sum(len(v) for v in by_class.values())
    return {"classes": by_class, "bytes_per_turn": None if moved is None else moved / turns}


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1))))]


def cuda_available(python: Path) -> bool:
    probe = "import torch; print(torch.cuda.is_available())"
    run = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=300)
    return run.stdout.strip().endswith("True")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--length-scale", type=float, default=0.05, help="x 64 tokens a block")
    parser.add_argument("--max-tokens", type=int, default=512, help="prompts cut to this")
    parser.add_argument("--think-scale", type=float, default=0.0, help="x the trace's waits")
    parser.add_argument("--block-size", type=int, default=32, help="vLLM's KV block, tokens")
    parser.add_argument("--model", help="default: SmolLM2-135M-Instruct, converted here")
    parser.add_argument("--vocab", type=int, default=49_152, help="of the model")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--node-cpu-gib", type=int, default=2)
    parser.add_argument("--offload-cpu-gib", type=int, default=2)
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--all", action="store_true", help="try the GPU-only configurations too")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        engine_main(json.loads(Path(args.engine).read_text()))
        return

    python = Path(args.vllm_python)
    python = python if python.is_absolute() else ROOT / python
    if not python.exists():
        print(f"no vLLM environment at {python}: nothing runs")
        return
    files = sorted(args.trace.glob("*.json"))
    sessions = []
    for index, path in enumerate(files):
        if len(sessions) == args.sessions:
            break
        try:
            sessions.append(
                session_prompts(path, index, args.length_scale, args.max_tokens, args.vocab)
            )
        except ValueError:
            continue
    work = Path(tempfile.mkdtemp(prefix="bench-peers-vllm-"))
    model = args.model
    if model is None:
        model = str(work / "smollm2")
        subprocess.run([str(python), "-m", "bench.engines.smollm2", model], check=True, cwd=ROOT)
    gpu = cuda_available(python)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results: dict[str, Any] = {}
    try:
        for config in args.configs:
            if config in GPU_ONLY and not gpu and not args.all:
                results[config] = {"skipped": GPU_ONLY[config] + "; no CUDA device here"}
                continue
            try:
                results[config] = run_config(config, args, python, model, sessions, work)
            except Exception as exc:
                results[config] = {"skipped": f"failed: {exc}"}
            shutil.rmtree(work / "vllm-fs", ignore_errors=True)
            shutil.rmtree(work / "node", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"{len(sessions)} sessions x {len(CLASSES)} requests of {args.trace.name}, length x "
        f"{args.length_scale} (cut at {args.max_tokens}), think x {args.think_scale}; model "
        f"{args.model or 'SmolLM2-135M-Instruct'}, block {args.block_size}; {started}"
    )
    print(
        f"{'config':<14} {'turn':<14} {'n':>3} {'TTFT p50':>9} {'TTFT p90':>9} "
        f"{'not prefilled':>13}  bytes/turn"
    )
    for config, got in results.items():
        if "skipped" in got:
            print(f"{config:<14} skipped: {got['skipped']}")
            continue
        per_turn = got["bytes_per_turn"]
        for turn, rows in got["classes"].items():
            seconds = [r["seconds"] for r in rows]
            saved = sum(r["cached"] for r in rows) / max(1, sum(r["tokens"] for r in rows))
            print(
                f"{config:<14} {turn:<14} {len(rows):>3} {percentile(seconds, 50) * 1e3:7.1f}ms "
                f"{percentile(seconds, 90) * 1e3:7.1f}ms {saved:12.1%}  "
                + ("-" if per_turn is None else f"{per_turn:,.0f}")
            )
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
