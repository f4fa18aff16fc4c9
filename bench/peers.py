"""sessioncache beside the storage paths its peers ship, on this machine, in one run and one
table: the same block sizes, the same number of blocks submitted at once, the same filesystem.

Systems (rows), each configured as its own documentation says:

- ``sessioncache same_host`` / ``sessioncache stream``: a ``sessioncache serve`` on README's
  defaults (CPU tier in shared memory, disk tier on, stores written behind to it), through
  ``KVTransfer`` (``store_from`` / ``load_into``) on the path named;
- ``sessioncache L2 adapter``: the same node through our LMCache L2 adapter
  (``SessionCacheL2``, same host), driven by LMCache's own ``lmcache bench l2``;
- ``lmcache fs`` and ``lmcache resp (redis)``: LMCache's filesystem L2 adapter and its Redis
  adapter (a private ``redis-server``), through ``lmcache bench l2``;
- ``vllm tiering fs``: vLLM's filesystem tier of the ``OffloadingConnector``
  (``vllm/v1/kv_offload/tiering/fs``), its ``FileSystemTierManager`` driven through its own
  API (``submit_store`` / ``submit_load`` / ``get_finished_jobs``) with a CPU tensor as the
  primary tier, in vLLM's environment (``.venv-vllm``, a child process). Above it the
  connector's GPU-to-CPU leg (``CPUOffloadingWorker`` of ``v1/kv_offload/cpu/gpu_worker.py``)
  asserts CUDA or XPU tensors, so the bench drives the layer below it: what the CPU tier
  cascades to the filesystem and promotes back;
- references of the same bytes: ``memcpy`` (numpy copies), ``dd fdatasync`` (one file written
  and ``fdatasync``-ed; its load reads the file back from the page cache) and ``loopback
  socket`` (the bytes over one TCP connection to a thread of this process).

Columns: store and load GB/s in two regimes, ``fresh`` (a new backend whose memory grows
during the run) and ``warm`` (its memory made before: the node's CPU tier preallocated,
Redis full of filler values that each store evicts, as ``bench.lmcache_l2`` makes them; the
filesystem rows and the references have no memory of their own, their two regimes differ by
the run only); each the best of ``--rounds`` rounds after one warm-up round, a round being
``--keys`` blocks submitted at once and waited for. ``p50``/``p99``: the time until all blocks
of a round are done (every block's latency at that many concurrent blocks), over the rounds.

Then, per system, on 256 KiB blocks: of ``--keys`` blocks stored, how many a second process
reads (another engine), how many survive a restart of the process that holds them (the node,
``redis-server``; for the file tiers a new process, the writer being gone), and whether a
second tenant reads them. The sessioncache node of that table has two API keys (two
tenants); everything else is as above.

Run: ``python -m bench.peers [--keys 64] [--sizes-kb 256 2048] [--rounds 5]
[--regimes fresh warm] [--vllm-python .venv-vllm/bin/python] [--json]``. 2048 KiB is also
vLLM's block of Llama-3.1-8B in bf16 (16 tokens x 32 layers x K and V x 8 heads x 128).
Needs the ``lmcache`` extra and ``redis-server`` on the PATH; without vLLM's environment
its rows say why they are missing.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20
LLAMA_8B_BLOCK = 16 * 32 * 2 * 8 * 128 * 2
"""vLLM's KV block of Llama-3.1-8B in bf16, 16 tokens: the OffloadingConnector's default chunk."""
README_NODE = {"SESSIONCACHE_DISK_BYTES": str(64 << 30)}
"""What ``bench.lookup.start`` turns off of README's node (durable uploads stay off: README)."""
BLOCK_TOKENS = 16
VLLM_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@dataclass
class Row:
    """One system at one block size in one regime: best GB/s and round times (ms)."""

    system: str
    size_kb: int
    regime: str
    store: float = 0.0
    load: float = 0.0
    store_p50: float = 0.0
    store_p99: float = 0.0
    load_p50: float = 0.0
    load_p99: float = 0.0
    missing: str = ""


@dataclass
class Sharing:
    """Of ``stored`` blocks: read by a second process, left after a restart, read by a second
    tenant (``None``: not measured, ``note`` says why)."""

    system: str
    stored: int
    second_process: int | None = None
    after_restart: int | None = None
    other_tenant: int | None = None
    needs: str = ""
    notes: list[str] = field(default_factory=list)


def percentile(values: list[float], pct: float) -> float:
    """Nearest rank, as ``lmcache bench l2`` computes its own."""
    ordered = sorted(values)
    rank = max(1, int(np.ceil(pct / 100 * len(ordered))))
    return ordered[rank - 1]


def timed_row(
    system: str,
    size_kb: int,
    regime: str,
    nbytes: int,
    store_s: list[float],
    load_s: list[float],
) -> Row:
    """A row from the measured rounds' seconds (the warm-up round left out by the caller)."""
    return Row(
        system,
        size_kb,
        regime,
        store=nbytes / min(store_s) / 1e9,
        load=nbytes / min(load_s) / 1e9,
        store_p50=percentile(store_s, 50) * 1e3,
        store_p99=percentile(store_s, 99) * 1e3,
        load_p50=percentile(load_s, 50) * 1e3,
        load_p99=percentile(load_s, 99) * 1e3,
    )


def blocks_of(keys: int, size: int, seed: int) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(keys)]


# -- sessioncache through KVTransfer ------------------------------------------------------


def node_env(warm: bool) -> dict[str, str]:
    env = dict(README_NODE)
    if warm:
        env["SESSIONCACHE_CPU_PREALLOCATE"] = "wait"
    return env


def kvtransfer_rows(
    work: Path, size_kb: int, regime: str, keys: int, rounds: int, cpu_bytes: int
) -> list[Row]:
    """Both data paths of one node, each a chain of ``keys`` fresh blocks per round, stored
    then loaded back into the caller's buffers."""
    from bench.lookup import start
    from sessioncache.connector.transfer import KVTransfer
    from sessioncache.hashing import Namespace

    size = size_kb * 1024
    blocks = blocks_of(keys, size, 1)
    out = [np.empty(size, np.uint8) for _ in range(keys)]
    data_dir = work / f"node-{size_kb}k-{regime}"
    proc, url = start(data_dir, cpu_bytes=cpu_bytes, extra_env=node_env(regime == "warm"))
    rows = []
    try:
        rng = np.random.default_rng(size_kb)
        for path in ("same_host", "stream"):
            namespace = Namespace(f"peers-{path}", BLOCK_TOKENS, "bf16", "x")
            store_s: list[float] = []
            load_s: list[float] = []
            with KVTransfer.from_url(url, namespace=namespace, path=path, timeout=300) as kv:
                for r in range(rounds + 1):
                    tokens = [int(t) for t in rng.integers(0, 50_000, BLOCK_TOKENS * keys)]
                    t0 = time.perf_counter()
                    kept = kv.store_from(tokens, blocks).blocks
                    t1 = time.perf_counter()
                    got = kv.load_into(tokens, out).blocks
                    t2 = time.perf_counter()
                    if kept != keys or got != keys:
                        raise RuntimeError(f"{path}: stored {kept}, loaded {got} of {keys}")
                    if not all(np.array_equal(a, b) for a, b in zip(blocks, out, strict=True)):
                        raise RuntimeError(f"{path}: loaded bytes differ")
                    if r:
                        store_s.append(t1 - t0)
                        load_s.append(t2 - t1)
            rows.append(
                timed_row(f"sessioncache {path}", size_kb, regime, keys * size, store_s, load_s)
            )
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(data_dir, ignore_errors=True)
        os.sync()
    return rows


# -- LMCache's L2 bench -----------------------------------------------------------------------

L2_SYSTEMS = {
    "sessioncache L2 adapter": "sessioncache same_host",
    "lmcache fs": "lmcache fs",
    "lmcache resp (redis)": "lmcache resp (redis)",
}
"""Our row names -> ``bench.lmcache_l2.Backend`` names."""


def l2_rows(
    work: Path, size_kb: int, regime: str, keys: int, rounds: int, cpu_bytes: int
) -> list[Row]:
    import bench.lmcache_l2 as l2

    l2.STRIPPED = False  # README's node
    rows: list[Row] = []
    for system, backend_name in L2_SYSTEMS.items():
        backend = l2.Backend(
            backend_name,
            work,
            size_kb,
            cpu_bytes=cpu_bytes,
            warm=regime == "warm",
            fill=keys * (rounds + 1) * size_kb * 1024,
            margin=2 * keys * size_kb * 1024 + (16 << 20),
        )
        out = work / f"l2-{size_kb}-{regime}-{len(rows)}.json"
        with backend as spec:
            metrics = l2.lmcache_bench(spec, keys, size_kb, rounds, out)
        got = l2.rates(metrics)
        row = Row(system, size_kb, regime, store=got["store"], load=got["load"])
        for op in (v for k, v in metrics.items() if k.startswith("op_")):
            name = str(op["operation"]).lower()
            if name in ("store", "load"):
                setattr(row, f"{name}_p50", float(op["duration_p50_ms"]))
                setattr(row, f"{name}_p99", float(op["duration_p99_ms"]))
        rows.append(row)
    return rows


def child(argv: list[str], what: str, env: dict[str, str] | None = None) -> str:
    """Run ``argv`` from the repository root; its stdout, or an error ending with its
    stderr."""
    run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{run.stderr[-3000:]}")
    return run.stdout


def lmcache_cli(spec: dict[str, Any], keys: int, size_kb: int, extra: list[str]) -> dict[str, Any]:
    """One ``lmcache bench l2`` run of one round, no warm-up (the same keys every time: its
    key universe is fixed by the flags); its JSON ``metrics``."""
    env = {
        **os.environ,
        "LMCACHE_DISABLE_BANNER": "1",
        "LMCACHE_TRACK_USAGE": "false",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        lmcache = ("-c", "from lmcache.cli.main import main; main()", "bench", "l2")
        child(
            [
                *(sys.executable, *lmcache, "--l2-adapter", json.dumps(spec)),
                *("--num-keys", str(keys), "--data-size-kb", str(size_kb)),
                *("--rounds", "1", "--warmup-rounds", "0", *extra),
                *("--format", "json", "--output", str(out), "-q"),
            ],
            f"lmcache bench l2 {extra}",
            env,
        )
        metrics: dict[str, Any] = json.loads(out.read_text())["metrics"]
    return metrics


def l2_hits(spec: dict[str, Any], keys: int, size_kb: int) -> int:
    """How many of the keys ``--only store`` wrote a new ``lmcache bench l2`` process finds."""
    metrics = lmcache_cli(spec, keys, size_kb, ["--only", "lookup", "--lookup-max-hit-rate", "1"])
    for op in (v for k, v in metrics.items() if k.startswith("op_")):
        if str(op["operation"]).lower() == "lookup":
            return round(float(op.get("actual_hit_rate", 0.0)) * int(op["total_keys"]))
    raise RuntimeError("lmcache bench l2 printed no lookup")


def l2_launch(
    system: str, where: Path, cpu_bytes: int
) -> tuple[subprocess.Popen[bytes] | None, dict[str, Any]]:
    """Start what holds ``system``'s blocks in ``where`` (again, after a restart)."""
    from bench.lmcache_l2 import start_redis
    from bench.lookup import start

    if system.startswith("sessioncache"):
        proc, url = start(where / "node", cpu_bytes=cpu_bytes, extra_env=README_NODE)
        params = {"url": url, "data_path": "same_host", "kv_layout": "bench"}
        return proc, {
            "type": "native_plugin",
            "module_path": "sessioncache.connector.lmcache",
            "class_name": "SessionCacheL2",
            "adapter_params": params,
        }
    if "resp" in system:
        proc, port = start_redis(where)
        return proc, {"type": "resp", "host": "127.0.0.1", "port": port}
    return None, {"type": "fs", "base_path": str(where)}


def l2_stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None:
        proc.terminate()
        proc.wait(30)


def l2_sharing(work: Path, keys: int, size_kb: int, cpu_bytes: int) -> list[Sharing]:
    """Per L2 adapter: store with one ``lmcache bench l2`` process, look up with a second,
    restart what holds the blocks (the node, ``redis-server``; nothing for ``fs``), look up
    again."""
    found = []
    for system in L2_SYSTEMS:
        where = work / f"share-{system.split()[1]}"
        where.mkdir(parents=True)
        share = Sharing(system, keys)
        proc, spec = l2_launch(system, where, cpu_bytes)
        try:
            lmcache_cli(spec, keys, size_kb, ["--only", "store"])
            share.second_process = l2_hits(spec, keys, size_kb)
            l2_stop(proc)
            proc, spec = l2_launch(system, where, cpu_bytes)
            share.after_restart = l2_hits(spec, keys, size_kb)
        finally:
            l2_stop(proc)
            shutil.rmtree(where, ignore_errors=True)
        if system.startswith("sessioncache"):
            share.needs = "the node's URL"
            share.notes.append("tenants: the adapter is one tenant's client (its api_key)")
        elif "resp" in system:
            share.needs = "the Redis address"
            share.notes.append(
                "restart: redis-server without RDB/AOF, as bench.lmcache_l2 runs it; "
                "persistence is Redis's own setting"
            )
            share.notes.append("tenants: none (keys carry the model name and chunk hash)")
        else:
            share.needs = "the same base_path"
            share.notes.append("restart: nothing holds the files but the directory")
            share.notes.append("tenants: none (keys carry the model name and chunk hash)")
        found.append(share)
    return found


def sessioncache_sharing(work: Path, keys: int, size_kb: int, cpu_bytes: int) -> Sharing:
    """A node with two tenants (two API keys): tenant a stores over the stream, a second
    process of tenant a loads, tenant b asks for the same tokens, the node is restarted
    (SIGTERM) on its data dir and tenant a loads again."""
    from bench.lookup import start
    from sessioncache.connector.transfer import KVTransfer
    from sessioncache.hashing import Namespace

    data_dir = work / "share-node"
    env = {**README_NODE, "SESSIONCACHE_API_KEYS": json.dumps({"key-a": "a", "key-b": "b"})}
    size = size_kb * 1024
    blocks = blocks_of(keys, size, 7)
    tokens = list(range(5000, 5000 + BLOCK_TOKENS * keys))
    namespace = Namespace("peers-share", BLOCK_TOKENS, "bf16", "x")
    share = Sharing("sessioncache (node)", keys, needs="the node's URL and an API key")
    proc, url = start(data_dir, cpu_bytes=cpu_bytes, extra_env=env)
    try:
        with KVTransfer.from_url(url, api_key="key-a", namespace=namespace, path="stream") as kv:
            kv.store_from(tokens, blocks)
        share.second_process = reader_process(url, "key-a", keys, size_kb, 7)
        share.other_tenant = reader_process(url, "key-b", keys, size_kb, 7)
        proc.terminate()
        proc.wait(60)
        proc, url = start(data_dir, cpu_bytes=cpu_bytes, extra_env=env)
        share.after_restart = reader_process(url, "key-a", keys, size_kb, 7)
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(data_dir, ignore_errors=True)
    share.notes.append("tenants: by API key, each tenant's ids salted apart (the node's setting)")
    return share


def reader_process(url: str, api_key: str, keys: int, size_kb: int, seed: int) -> int:
    """In a new process: how many of the blocks ``sessioncache_sharing`` stored load back
    byte for byte with this API key."""
    stdout = child(
        [
            *(sys.executable, "-m", "bench.peers", "--read-node", url, api_key),
            *("--keys", str(keys), "--sizes-kb", str(size_kb), "--seed", str(seed)),
        ],
        "reader",
    )
    return int(stdout.strip().splitlines()[-1])


def read_node(url: str, api_key: str, keys: int, size_kb: int, seed: int) -> int:
    from sessioncache.connector.transfer import KVTransfer
    from sessioncache.hashing import Namespace

    size = size_kb * 1024
    blocks = blocks_of(keys, size, seed)
    out = [np.zeros(size, np.uint8) for _ in range(keys)]
    tokens = list(range(5000, 5000 + BLOCK_TOKENS * keys))
    namespace = Namespace("peers-share", BLOCK_TOKENS, "bf16", "x")
    with KVTransfer.from_url(url, api_key=api_key, namespace=namespace, path="stream") as kv:
        got = kv.load_into(tokens, out).blocks
    return sum(np.array_equal(a, b) for a, b in zip(blocks[:got], out[:got], strict=True))


# -- vLLM's tiering filesystem backend (runs in vLLM's environment) ------------------------


def vllm_fs_child(root: str, mode: str, keys: int, size: int, rounds: int, seed: int) -> Any:
    """In vLLM's environment. ``bench``: rounds of ``keys`` fresh blocks stored from a CPU
    primary tier and loaded back into it, seconds per round; ``store``: one set of blocks
    (``seed``) stored; ``read``: how many of those load back byte for byte."""
    import torch
    from vllm.v1.kv_offload.base import OffloadingSpec, ReqContext, make_offload_key
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

    class Spec(OffloadingSpec):  # type: ignore[misc]
        def get_manager(self) -> Any:
            raise NotImplementedError

        def get_worker(self, kv_caches: Any) -> Any:
            raise NotImplementedError

    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(BLOCK_TOKENS, ("model.layers",), 0),),
        worker_kv_bytes_per_block=size,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="peers",
        model=OffloadingModelConfig(VLLM_MODEL, "bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
    )
    # Page-aligned, as vLLM's own CPU tier (an mmap'ed region): O_DIRECT needs it.
    region = mmap.mmap(-1, 2 * keys * size)
    primary = torch.frombuffer(region, dtype=torch.uint8).view(
        2 * keys, size
    )  # stores 0.., loads keys..
    tier = FileSystemTierManager(Spec(config), memoryview(primary.numpy()), "fs", root)
    context = ReqContext("peers")
    next_job = iter(range(1 << 30))

    def key(tag: str, i: int) -> Any:
        import hashlib

        return make_offload_key(hashlib.sha256(f"{tag}/{i}".encode()).digest(), 0)

    def run(tag: str, load: bool) -> tuple[float, int]:
        """Submit one job per block, all at once; seconds until all are done, and how many
        succeeded."""
        jobs = [
            TransferJob(
                next(next_job),
                [key(tag, i)],
                np.array([keys + i if load else i]),
                is_promotion=load,
                req_context=context,
            )
            for i in range(keys)
        ]
        t0 = time.perf_counter()
        for job in jobs:
            (tier.submit_load if load else tier.submit_store)(job)
        done = ok = 0
        while done < keys:
            for result in tier.get_finished_jobs():
                done += 1
                ok += bool(result.success)
            if done < keys:
                time.sleep(0.0001)
        return time.perf_counter() - t0, ok

    def fill(s: int) -> None:
        primary[:keys].copy_(torch.from_numpy(np.stack(blocks_of(keys, size, s))))

    try:
        if mode == "store":
            fill(seed)
            return run(f"share-{seed}", load=False)[1]
        if mode == "read":
            primary[keys:].zero_()
            _, ok = run(f"share-{seed}", load=True)
            expect = np.stack(blocks_of(keys, size, seed))
            got = primary[keys:].numpy()
            return sum(np.array_equal(expect[i], got[i]) for i in range(keys)) if ok else 0
        fill(seed)
        store_s, load_s = [], []
        for r in range(rounds + 1):
            primary[keys:].zero_()
            s, stored = run(f"bench-{size}-{r}", load=False)
            ld, loaded = run(f"bench-{size}-{r}", load=True)
            if stored != keys or loaded != keys:
                raise RuntimeError(f"stored {stored}, loaded {loaded} of {keys}")
            if not torch.equal(primary[:keys], primary[keys:]):
                raise RuntimeError("loaded bytes differ")
            if r:
                store_s.append(s)
                load_s.append(ld)
        return {"store": store_s, "load": load_s, "o_direct": tier._use_o_direct}
    finally:
        tier.shutdown()


def vllm_python(arg: str) -> Path | None:
    path = Path(arg) if Path(arg).is_absolute() else ROOT / arg
    return path if path.exists() else None


def vllm_call(python: Path, root: Path, mode: str, keys: int, size: int, rounds: int) -> Any:
    stdout = child(
        [
            *(str(python), "-m", "bench.peers", "--vllm-fs", str(root), mode),
            *("--keys", str(keys), "--sizes-kb", str(size // 1024), "--rounds", str(rounds)),
        ],
        f"vLLM fs tier ({mode})",
        {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
    )
    return json.loads(stdout.strip().splitlines()[-1])


def vllm_rows(
    python: Path | None, work: Path, size_kb: int, regime: str, keys: int, rounds: int
) -> list[Row]:
    if python is None:
        return [Row("vllm tiering fs", size_kb, regime, missing="no vLLM environment")]
    root = work / f"vllm-fs-{size_kb}k-{regime}"
    try:
        got = vllm_call(python, root, "bench", keys, size_kb * 1024, rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        os.sync()
    row = timed_row("vllm tiering fs", size_kb, regime, keys * size_kb * 1024, *got_times(got))
    if not got["o_direct"]:
        row.missing = "(buffered: O_DIRECT refused here)"
    return [row]


def got_times(got: dict[str, Any]) -> tuple[list[float], list[float]]:
    return [float(s) for s in got["store"]], [float(s) for s in got["load"]]


def vllm_sharing(python: Path | None, work: Path, keys: int, size_kb: int) -> Sharing:
    share = Sharing("vllm tiering fs", keys, needs="the same root_dir and model config")
    if python is None:
        share.notes.append("not run: no vLLM environment")
        return share
    root = work / "share-vllm-fs"
    try:
        vllm_call(python, root, "store", keys, size_kb * 1024, 0)
        share.second_process = int(vllm_call(python, root, "read", keys, size_kb * 1024, 0))
        share.after_restart = share.second_process
    finally:
        shutil.rmtree(root, ignore_errors=True)
    share.notes.append(
        "restart: the writer is the engine, gone; a new one reads its files (the same run "
        "as the second process)"
    )
    share.notes.append(
        "second process: same block hashes needs the same hash seed (sha256 default: fixed "
        "seed; otherwise PYTHONHASHSEED pinned on every engine)"
    )
    share.notes.append(
        "tenants: none in the tier (files 0644 by key); a request's cache_salt changes its "
        "hashes, set by each caller"
    )
    return share


# -- references ---------------------------------------------------------------------------


def memcpy_rows(size_kb: int, regime: str, keys: int, rounds: int) -> Row:
    size = size_kb * 1024
    blocks = blocks_of(keys, size, 3)
    out = [np.ones(size, np.uint8) for _ in range(keys)]

    def copy(src: list[np.ndarray[Any, Any]], dst: list[np.ndarray[Any, Any]]) -> float:
        t0 = time.perf_counter()
        for a, b in zip(src, dst, strict=True):
            np.copyto(b, a)
        return time.perf_counter() - t0

    store_s = [copy(blocks, out) for _ in range(rounds + 1)][1:]
    load_s = [copy(out, blocks) for _ in range(rounds + 1)][1:]
    return timed_row("memcpy", size_kb, regime, keys * size, store_s, load_s)


def dd_row(work: Path, size_kb: int, regime: str, keys: int, rounds: int) -> Row:
    """``bench.store_paths``'s reference (the blocks written to one file, fdatasync-ed); the
    load reads the file back from the page cache."""
    from bench.store_paths import dd_fdatasync

    size = size_kb * 1024
    blocks = blocks_of(keys, size, 4)
    out = [np.empty(size, np.uint8) for _ in range(keys)]
    target = work / "dd-reference"
    store_s, load_s = [], []
    for r in range(rounds + 1):
        stored = dd_fdatasync(work, blocks)  # the file it wrote is gone: written again, read
        target.write_bytes(b"".join(block.data for block in blocks))
        t0 = time.perf_counter()
        with open(target, "rb", buffering=0) as f:
            for block in out:
                f.readinto(block.data)
        loaded = time.perf_counter() - t0
        target.unlink()
        if r:
            store_s.append(stored)
            load_s.append(loaded)
    return timed_row("dd fdatasync", size_kb, regime, keys * size, store_s, load_s)


def socket_row(size_kb: int, regime: str, keys: int, rounds: int) -> Row:
    """The blocks sent over one loopback TCP connection to a thread that reads them into
    buffers and answers one byte; the same in both directions (store = load)."""
    size = size_kb * 1024
    blocks = blocks_of(keys, size, 5)
    sink = [np.empty(size, np.uint8) for _ in range(keys)]
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            for _ in range(rounds + 1):
                for block in sink:
                    view, got = memoryview(block), 0
                    while got < size:
                        n = conn.recv_into(view[got:])
                        if not n:
                            return
                        got += n
                conn.sendall(b"k")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    seconds = []
    with socket.create_connection(("127.0.0.1", port)) as conn:
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            for block in blocks:
                conn.sendall(block.data)
            conn.recv(1)
            seconds.append(time.perf_counter() - t0)
    thread.join(30)
    listener.close()
    return timed_row("loopback socket", size_kb, regime, keys * size, seconds[1:], seconds[1:])


# -- the run ------------------------------------------------------------------------------


def attempt(rows: list[Row], system: str, size_kb: int, regime: str, fn: Callable[[], Any]) -> None:
    """Run one system's rows; a system that fails is a row saying why, not a lost run."""
    try:
        got = fn()
    except Exception as exc:
        reason = str(exc).strip().splitlines()
        rows.append(
            Row(system, size_kb, regime, missing=f"failed: {reason[-1] if reason else exc}")
        )
        return
    rows.extend(got if isinstance(got, list) else [got])


def fmt(row: Row) -> str:
    head = f"{row.size_kb:>6}k {row.regime:<6} {row.system:<24}"
    if not row.store:
        return f"{head} {row.missing}"
    tail = f"  {row.missing}" if row.missing else ""
    return (
        f"{head} {row.store:6.2f} {row.load:6.2f} {row.store_p50:8.1f} {row.store_p99:8.1f} "
        f"{row.load_p50:8.1f} {row.load_p99:8.1f}{tail}"
    )


def count(value: int | None) -> str:
    return "-" if value is None else str(value)


GROUPS = ("sessioncache", "lmcache", "vllm", "references")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=64, help="blocks submitted at once")
    parser.add_argument("--sizes-kb", type=int, nargs="+", default=[256, LLAMA_8B_BLOCK >> 10])
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per operation")
    parser.add_argument(
        "--regimes", nargs="+", choices=["fresh", "warm"], default=["fresh", "warm"]
    )
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument(
        "--systems", nargs="+", choices=list(GROUPS), default=list(GROUPS), help="rows to run"
    )
    parser.add_argument("--no-sharing", action="store_true", help="leave out the second table")
    parser.add_argument("--dir", default=None, help="where every system's files go")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    parser.add_argument("--vllm-fs", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--read-node", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_fs:
        root, mode = args.vllm_fs
        size = args.sizes_kb[0] * 1024
        print(json.dumps(vllm_fs_child(root, mode, args.keys, size, args.rounds, 11)))
        return
    if args.read_node:
        url, api_key = args.read_node
        print(read_node(url, api_key, args.keys, args.sizes_kb[0], args.seed))
        return

    python = vllm_python(args.vllm_python)
    work = Path(tempfile.mkdtemp(prefix="bench-peers-", dir=args.dir))
    per_run = args.keys * (args.rounds + 1) * max(args.sizes_kb) * 1024
    cpu_bytes = max(1 << 30, 2 * per_run)
    rows: list[Row] = []
    sharing: list[Sharing] = []
    started = time.time()
    try:
        for size_kb in args.sizes_kb:
            for regime in args.regimes:
                at = (size_kb, regime, args.keys, args.rounds)
                systems: dict[str, tuple[str, Callable[[], Any]]] = {
                    "sessioncache": (
                        "sessioncache",
                        partial(kvtransfer_rows, work, *at, cpu_bytes),
                    ),
                    "lmcache bench l2": ("lmcache", partial(l2_rows, work, *at, cpu_bytes)),
                    "vllm tiering fs": ("vllm", partial(vllm_rows, python, work, *at)),
                    "memcpy": ("references", partial(memcpy_rows, *at)),
                    "dd fdatasync": ("references", partial(dd_row, work, *at)),
                    "loopback socket": ("references", partial(socket_row, *at)),
                }
                for system, (group, fn) in systems.items():
                    if group in args.systems:
                        attempt(rows, system, size_kb, regime, fn)
        if not args.no_sharing:
            at2 = (work, args.keys, min(args.sizes_kb))
            shares: dict[str, tuple[str, Callable[[], Any]]] = {
                "sessioncache (node)": (
                    "sessioncache",
                    partial(sessioncache_sharing, *at2, cpu_bytes),
                ),
                "lmcache bench l2": ("lmcache", partial(l2_sharing, *at2, cpu_bytes)),
                "vllm tiering fs": ("vllm", partial(vllm_sharing, python, *at2)),
            }
            for name, (group, fn) in shares.items():
                if group not in args.systems:
                    continue
                try:
                    got = fn()
                except Exception as exc:
                    lines = str(exc).strip().splitlines()
                    got = Sharing(name, args.keys, notes=[f"failed: {lines[-1] if lines else exc}"])
                sharing.extend(got if isinstance(got, list) else [got])
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"{args.keys} blocks submitted at once per round; GB/s of the best of {args.rounds} "
        "rounds after one warm-up; p50/p99: ms until all blocks of a round are done; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}"
    )
    print(
        f"{'size':>7} {'regime':<6} {'system':<24} {'store':>6} {'load':>6} "
        f"{'st p50':>8} {'st p99':>8} {'ld p50':>8} {'ld p99':>8}"
    )
    for row in rows:
        print(fmt(row))
    if sharing:
        print(
            f"\nof {args.keys} blocks of {min(args.sizes_kb)} KiB stored: read by a second "
            "process, left after a restart, read by a second tenant"
        )
        print(f"{'system':<24} {'2nd proc':>8} {'restart':>8} {'tenant b':>8}  needs")
        for share in sharing:
            print(
                f"{share.system:<24} {count(share.second_process):>8} "
                f"{count(share.after_restart):>8} {count(share.other_tenant):>8}  {share.needs}"
            )
            for note in share.notes:
                print(f"{'':<24}   {note}")
    if args.json:
        print(
            json.dumps({"rows": [asdict(r) for r in rows], "sharing": [asdict(s) for s in sharing]})
        )


if __name__ == "__main__":
    main()
