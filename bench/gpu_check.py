"""The prepared device check: the CUDA paths on a GPU machine, in one run, as a JSON report.

    bench/gpu_check.sh               # on a bare GPU machine: installs .gpu-wheels/, runs this
    python -m bench.gpu_check --cpu  # the same, as a dry run on tiny sizes (CI runs it so)

Sections (each reported on its own; one that fails leaves the others, and the report is
rewritten after each, so a run stopped at its limit still leaves what it measured):

- ``tests``: ``pytest tests/gpu`` (parametrised over ``cpu`` and ``cuda``).
- ``vllm``: ``pytest tests/vllm/test_vllm_gpu.py`` where vLLM's CUDA build is installed (else
  skipped, saying so): the DeepSeek-V2 and Kimi Linear layouts shared through the node by two
  fresh engines, logprobs within 1e-3 of vLLM's own prefix-cache resume (``shares``).
- ``gpu_tier``: GPU tier put (from device tensors) and get plus the copy into the caller's
  tensor (get returns a view), in GB/s, beside torch's device-to-device copy of the same
  bytes in the same blocks.
- ``host_to_device``: GB/s into device tensors from the node's shared CPU tier through a
  same-host client (its mappings registered with CUDA), from this process's own registered
  shared tier, and from a pinned and an unpinned ``torch.empty`` of the same bytes.
- ``ttft``: an 8B-shaped random Llama (32 layers, 8 KV heads, head dim 128, bf16) run by
  ``CachedPrefixRunner`` over the same-host path, at 8K- and 32K-token prefixes: TTFT cached
  against recomputed (median of 3 warm runs), the last position's logits against the cold
  run's, and the load's GB/s beside the GPU's own prefill rate in GB/s of KV.

The node is ``sessioncache serve`` on its README defaults (disk tier on, stores written
behind) with a CPU tier large enough for the 32K prefix (``--cpu-bytes``). ``targets`` in the
report says which of the issue's targets were met. ``--cpu`` runs everything on
``torch.device("cpu")`` with a 2-layer model and small sizes: a check of the script, not a
measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from bench.ttft import Node
from sessioncache.connector import SessionCacheClient
from sessioncache.connector.samehost import SameHostClient, map_segments, registered_segments
from sessioncache.connector.transfer import KVTransfer
from sessioncache.connector.transformers import CachedPrefixRunner, KVShape, namespace_for
from sessioncache.devices import DeviceCopies
from sessioncache.hashing import BlockHash, Namespace, block_hashes
from sessioncache.hostpin import HostRegistration, read_only_supported
from sessioncache.tiers.base import PutItem
from sessioncache.tiers.cpu import SharedCpuTier
from sessioncache.tiers.gpu import GpuTier

GiB = 1 << 30
MiB = 1 << 20
ROOT_DIR = Path(__file__).resolve().parent.parent

FULL = {
    "layers": 32,
    "hidden": 4096,
    "heads": 32,
    "kv_heads": 8,
    "head_dim": 128,
    "intermediate": 14336,
    "vocab": 128256,
    "prefixes": [8192, 32768],
    "block_tokens": 256,
    "copy_bytes": 2 * GiB,
    "block_bytes": 32 * MiB,
    "cpu_bytes": 12 * GiB,
}
DRY = {
    "layers": 2,
    "hidden": 256,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 64,
    "intermediate": 512,
    "vocab": 1024,
    "prefixes": [256, 1024],
    "block_tokens": 64,
    "copy_bytes": 64 * MiB,
    "block_bytes": 4 * MiB,
    "cpu_bytes": 1 * GiB,
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(device: torch.device, fn: Callable[[], None], repeat: int = 3) -> float:
    """The fastest of ``repeat`` runs of ``fn`` (after one warm-up), synchronised."""
    fn()
    sync(device)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def random_bytes(nbytes: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)


def ids(n: int, seed: int) -> list[BlockHash]:
    ns = Namespace("gpu-check", 16, "bf16", "bytes")
    return block_hashes(ns, np.random.default_rng(seed).integers(0, 50_000, 16 * n))


# -- sections ---------------------------------------------------------------------------------


def section_tests(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    return run_pytest(args.tests, out_dir / "gpu_tests.xml", args.tests_timeout_s)[0]


def section_vllm(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """``tests/vllm/test_vllm_gpu.py`` (MLA shared through the node by two engines, exact to
    1e-3: the DeepSeek-V2 and Kimi Linear layouts) with this Python's vLLM, where vLLM's CUDA
    build is installed. A bare machine has none: the section says so and is skipped."""
    if importlib.util.find_spec("vllm") is None:
        return {
            "skipped": "vLLM is not installed here: pip install vllm==0.32.0 (its CUDA build), "
            "then bench/gpu_check.sh --skip gpu_tier,host_to_device,ttft,tests"
        }
    env = {**os.environ, "SESSIONCACHE_VLLM_PYTHON": sys.executable}
    result, printed = run_pytest(
        ["-s", "tests/vllm/test_vllm_gpu.py"], out_dir / "gpu_vllm.xml", args.vllm_timeout_s, env
    )
    return result | {"shares": printed}


def run_pytest(
    tests: list[str], junit: Path, timeout_s: float, env: dict[str, str] | None = None
) -> tuple[dict[str, Any], list[Any]]:
    """``pytest tests``: its outcome per case (from its JUnit XML), and the JSON objects it
    printed one a line."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    cmd += ["--junitxml", str(junit)]
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=ROOT_DIR, capture_output=True, text=True, timeout=timeout_s, env=env
    )
    printed = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                printed.append(json.loads(line))
    result: dict[str, Any] = {
        "returncode": proc.returncode,
        "seconds": round(time.perf_counter() - start, 1),
        "output_tail": (proc.stdout + proc.stderr)[-3000:],
    }
    if junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        result |= {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        result["cases"] = [
            {
                "name": case.get("name"),
                "outcome": "failed"
                if case.find("failure") is not None or case.find("error") is not None
                else "skipped"
                if case.find("skipped") is not None
                else "passed",
            }
            for case in suite.iter("testcase")
        ]
    result["passed"] = proc.returncode == 0
    return result, printed


def section_gpu_tier(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    size, total = args.sizes["block_bytes"], args.sizes["copy_bytes"]
    n = total // size
    src = random_bytes(total, device, seed=1).view(n, size)
    dst = torch.empty_like(src)
    hashes = ids(n, 2)
    tier = GpuTier(total + size, device=device)

    def put() -> None:
        for h in hashes:
            tier.delete(h)
        for h, row in zip(hashes, src, strict=True):
            tier.put(PutItem(h, row, b"\0" * 16))

    def get_and_copy() -> None:
        for h, row in zip(hashes, dst, strict=True):
            view = tier.get(h)
            assert view is not None
            row.copy_(view)

    def reference() -> None:
        for a, b in zip(dst, src, strict=True):
            a.copy_(b)

    put_s = best_seconds(device, put)
    get_s = best_seconds(device, get_and_copy)
    assert torch.equal(dst, src), "get returned other bytes"
    ref_s = best_seconds(device, reference)
    one_s = best_seconds(device, lambda: dst.copy_(src))
    tier.close()
    result = {
        "device": str(device),
        "block_bytes": size,
        "blocks": n,
        "put_gbps": gbps(total, put_s),
        "get_and_copy_gbps": gbps(total, get_s),
        "torch_d2d_same_blocks_gbps": gbps(total, ref_s),
        "torch_d2d_one_copy_gbps": gbps(total, one_s),
    }
    result["get_vs_d2d"] = round(
        result["get_and_copy_gbps"] / result["torch_d2d_same_blocks_gbps"], 3
    )
    result["put_vs_d2d"] = round(result["put_gbps"] / result["torch_d2d_same_blocks_gbps"], 3)
    return result


def section_host_to_device(
    args: argparse.Namespace, device: torch.device, node: Node
) -> dict[str, Any]:
    size, total = args.sizes["block_bytes"], args.sizes["copy_bytes"]
    n = total // size
    dst = torch.empty((n, size), dtype=torch.uint8, device=device)
    host = random_bytes(total, device, seed=3).cpu().view(n, size)  # made on the device: fast

    def copy_rows(rows: list[Any]) -> Callable[[], None]:
        def run() -> None:
            with DeviceCopies() as copies:
                for d, s in zip(dst, rows, strict=True):
                    copies.copy(d, s)

        return run

    result: dict[str, Any] = {
        "device": str(device),
        "block_bytes": size,
        "blocks": n,
        "read_only_registration_supported": read_only_supported(device)
        if device.type == "cuda"
        else None,
    }
    # the user's path: a same-host client loads from the node's shared CPU tier
    with SameHostClient.discover(node.url, timeout=300) as client:
        ns = Namespace("gpu-check-h2d", 16, "bf16", f"bytes-{size}")
        root = client.resolve(ns)
        tokens = np.random.default_rng(4).integers(0, 50_000, 16 * n).astype(np.uint32)
        chain = client.block_hashes(root, tokens)
        ack = client.store(root, tokens, list(host))
        result["stored"] = ack.kept
        map_segments(client, device)

        def same_host() -> None:
            found = client.locate(root, chain, lease_ms=120_000)
            if found.located != n:
                raise RuntimeError(f"{found.located} of {n} blocks located")
            client.load_into(found, list(dst))

        t = best_seconds(device, same_host)
        assert torch.equal(dst.cpu(), host), "the same-host load returned other bytes"
        result["same_host_client_gbps"] = gbps(total, t)
        result["client_registered_segments"] = len(registered_segments(client))
    # this process's own shared tier, registered as the node registers its segments
    before = HostRegistration.registered_bytes
    tier = SharedCpuTier(total + 64 * MiB, register_cuda=True)
    hashes = ids(n, 5)
    for h, row in zip(hashes, host, strict=True):
        tier.put(PutItem(h, row, b"\0" * 16))
    views = [tier.get(h) for h in hashes]
    result["registered_tier_gbps"] = gbps(total, best_seconds(device, copy_rows(views)))
    result["tier_registered_bytes"] = HostRegistration.registered_bytes - before
    pinned = torch.empty((n, size), dtype=torch.uint8, pin_memory=device.type == "cuda")
    pinned.copy_(host)
    result["pinned_gbps"] = gbps(total, best_seconds(device, copy_rows(list(pinned))))
    unpinned = host.clone()
    result["unpinned_gbps"] = gbps(total, best_seconds(device, copy_rows(list(unpinned))))
    tier.close()
    result["same_host_vs_pinned"] = round(
        result["same_host_client_gbps"] / result["pinned_gbps"], 3
    )
    result["registered_tier_vs_pinned"] = round(
        result["registered_tier_gbps"] / result["pinned_gbps"], 3
    )
    result["registrations_refused"] = HostRegistration.refused
    return result


def connect(kv: KVTransfer, device: torch.device) -> None:
    """Connect ``kv`` over the same-host path now, and map (and register) the node's memory
    before the first load, as an engine does at start."""
    conn = kv.connection
    if isinstance(conn, SameHostClient):
        map_segments(conn, device)


def build_llama(sizes: dict[str, Any], device: torch.device) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=sizes["vocab"],
        hidden_size=sizes["hidden"],
        intermediate_size=sizes["intermediate"],
        num_hidden_layers=sizes["layers"],
        num_attention_heads=sizes["heads"],
        num_key_value_heads=sizes["kv_heads"],
        head_dim=sizes["head_dim"],
        max_position_embeddings=max(sizes["prefixes"]) + 1024,
    )
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()  # bf16 parameters; the rotary frequencies stay float32


def section_ttft(args: argparse.Namespace, device: torch.device, node: Node) -> dict[str, Any]:
    sizes = args.sizes
    start = time.perf_counter()
    model = build_llama(sizes, device)
    shape = KVShape.of(model)
    bt = sizes["block_tokens"]
    result: dict[str, Any] = REPORT.setdefault("ttft", {})  # written as each prefix ends
    result |= {
        "device": str(device),
        "model": {k: sizes[k] for k in ("layers", "hidden", "kv_heads", "head_dim", "vocab")},
        "kv_bytes_per_token": shape.block_bytes(1, torch.bfloat16),
        "block_tokens": bt,
        "model_build_s": round(time.perf_counter() - start, 1),
        "prefixes": {},
    }
    gen = torch.Generator().manual_seed(9)
    with torch.inference_mode():
        # warm-up: kernels, cuBLAS and the carriers' first connections, on a prompt of its own
        warm_ns = namespace_for(model, block_tokens=bt, model_id="bench/gpu-check-warmup")
        with (
            SessionCacheClient(node.url, namespace=warm_ns, timeout=600) as client,
            KVTransfer(client, path="same_host") as kv,
        ):
            connect(kv, device)
            runner = CachedPrefixRunner(model, client, transfer=kv, room_tokens=16)
            prompt = [
                int(t) for t in torch.randint(0, sizes["vocab"], (4 * bt + 1,), generator=gen)
            ]
            pre = runner.prefill(prompt, last_logits_only=True)
            runner.save(prompt, pre.cache)
            runner.prefill(prompt, last_logits_only=True)
        for tokens in sizes["prefixes"]:
            result["prefixes"][str(tokens)] = one_prefix(model, node, device, tokens, bt, gen)
            write_report(args)  # each prefix's figures as soon as they exist
    return result


def one_prefix(
    model: Any, node: Node, device: torch.device, tokens: int, bt: int, gen: torch.Generator
) -> dict[str, Any]:
    vocab = model.config.vocab_size
    ns = namespace_for(model, block_tokens=bt, model_id=f"bench/gpu-check-{tokens}")
    prompt = [int(t) for t in torch.randint(0, vocab, (tokens,), generator=gen)]
    with (
        SessionCacheClient(node.url, namespace=ns, timeout=600) as client,
        KVTransfer(client, path="same_host") as kv,
    ):
        connect(kv, device)
        runner = CachedPrefixRunner(model, client, transfer=kv, room_tokens=16)
        sync(device)
        t0 = time.perf_counter()
        cold = runner.prefill(prompt, last_logits_only=True)
        sync(device)
        cold_s = time.perf_counter() - t0
        cold_logits = cold.logits[0, -1].float().clone()
        t0 = time.perf_counter()
        saved = runner.save(prompt, cold.cache)
        save_s = time.perf_counter() - t0
        del cold
        if device.type == "cuda":
            torch.cuda.empty_cache()
        warm_s: list[float] = []
        load_s: list[float] = []
        transfer_s: list[float] = []
        nbytes = 0
        cached = 0
        logits = cold_logits
        for _ in range(3):
            sync(device)
            t0 = time.perf_counter()
            warm = runner.prefill(prompt, last_logits_only=True)
            sync(device)
            warm_s.append(time.perf_counter() - t0)
            load_s.append(warm.timings.get("load", 0.0))
            got = runner.last_load
            assert got is not None
            transfer_s.append(got.seconds)
            nbytes, cached = got.nbytes, warm.cached_tokens
            logits = warm.logits[0, -1].float()
            del warm
    kv_bytes = tokens * KVShape.of(model).block_bytes(1, torch.bfloat16)
    diff = (logits - cold_logits).abs()
    cos = torch.nn.functional.cosine_similarity(logits, cold_logits, dim=0).item()
    warm_med = statistics.median(warm_s)
    return {
        "tokens": tokens,
        "cached_tokens": cached,
        "kv_bytes": kv_bytes,
        "cold_ttft_s": round(cold_s, 4),
        "cached_ttft_s": round(warm_med, 4),
        "cached_ttft_runs_s": [round(x, 4) for x in warm_s],
        "speedup": round(cold_s / warm_med, 2),
        "save_s": round(save_s, 3),
        "saved_blocks": getattr(saved, "blocks", None),
        "load_transfer_gbps": gbps(nbytes, statistics.median(transfer_s)),
        "load_with_rebuild_gbps": gbps(nbytes, statistics.median(load_s)),
        "gpu_prefill_kv_gbps": gbps(kv_bytes, cold_s),
        "logits_max_abs_diff": round(diff.max().item(), 5),
        "logits_max_abs": round(cold_logits.abs().max().item(), 5),
        "logits_cosine": round(cos, 6),
        "same_top1": bool(int(logits.argmax()) == int(cold_logits.argmax())),
        # bf16 tolerance: the cached run computes the suffix in another kernel shape than
        # the cold run, so equal up to bf16 rounding, not bit for bit
        "logits_equal_within_bf16": bool(cos >= 0.999),
    }


# -- the report -------------------------------------------------------------------------------

REPORT: dict[str, Any] = {}


def write_report(args: argparse.Namespace) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(REPORT, indent=2, default=str))


def targets(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, each met or not (None: not measured)."""
    h2d = report.get("host_to_device") or {}
    tier = report.get("gpu_tier") or {}
    ttft = (report.get("ttft") or {}).get("prefixes", {})
    long = ttft.get(str(max(report["sizes"]["prefixes"]))) or {}
    ratio = h2d.get("same_host_vs_pinned")
    get = tier.get("get_vs_d2d")
    speed = long.get("speedup")
    return {
        "h2d_from_shared_tier_vs_pinned_ge_0.8": None if ratio is None else ratio >= 0.8,
        "gpu_tier_get_vs_d2d_ge_0.5": None if get is None else get >= 0.5,
        "ttft_longest_prefix_speedup_ge_10x": None if speed is None else speed >= 10,
        "ttft_logits_within_bf16": long.get("logits_equal_within_bf16"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="dry run on the CPU, tiny sizes")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument(
        "--skip", default="", help="comma-separated sections to skip (tests,gpu_tier,...)"
    )
    parser.add_argument("--tests-timeout-s", type=float, default=100.0)
    parser.add_argument("--vllm-timeout-s", type=float, default=900.0)
    parser.add_argument(
        "--tests",
        nargs="+",
        default=["tests/gpu"],
        help="what the tests section runs (default tests/gpu)",
    )
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --cpu for a dry run")
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    args.sizes = DRY if args.cpu else FULL
    skip = {s for s in args.skip.split(",") if s}
    started = time.perf_counter()
    REPORT.update(
        {
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "dry_run": args.cpu,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "sizes": args.sizes,
        }
    )
    write_report(args)
    out_dir = args.out.parent

    def run(name: str, fn: Callable[[], dict[str, Any]]) -> None:
        if name in skip:
            REPORT[name] = {"skipped": True}
            return
        t0 = time.perf_counter()
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            REPORT[name] = fn()
        except BaseException as exc:  # a failed section leaves the others
            REPORT[name] = {"error": repr(exc), "traceback": traceback.format_exc()[-4000:]}
            if isinstance(exc, KeyboardInterrupt):
                raise
        REPORT[name]["section_s"] = round(time.perf_counter() - t0, 1)
        print(f"[gpu_check] {name}: {json.dumps(REPORT[name], default=str)[:2000]}", flush=True)
        write_report(args)

    run("gpu_tier", lambda: section_gpu_tier(args, device))
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        node = Node(Path(tmp) / "data", args.sizes["cpu_bytes"], 64 * GiB, durable=False)
        try:
            run("host_to_device", lambda: section_host_to_device(args, device, node))
            run("ttft", lambda: section_ttft(args, device, node))
        finally:
            node.stop()
            log = next(Path(tmp).glob("serve-*.log"), None)
            if log is not None:
                REPORT["node_log_tail"] = log.read_text(errors="replace")[-2000:]
    # last: the measurements above are what a short lease must not lose
    run("tests", lambda: section_tests(args, out_dir))
    run("vllm", lambda: section_vllm(args, out_dir))
    REPORT["targets"] = targets(REPORT)
    REPORT["total_s"] = round(time.perf_counter() - started, 1)
    write_report(args)
    print(json.dumps(REPORT["targets"]), flush=True)
    failed = [
        k for k in ("tests", "gpu_tier", "host_to_device", "ttft", "vllm") if "error" in REPORT[k]
    ]
    tests_ok = REPORT["tests"].get("passed", True) and REPORT["vllm"].get("passed", True)
    sys.exit(1 if failed or not tests_ok else 0)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
