"""``HybridRunner``: random-weight transformers models of three hybrid layouts (Gemma 3's
sliding windows, Qwen3-Next's Gated DeltaNet states, Falcon-H1's Mamba states beside attention
in every layer) resumed from a cached prefix at several boundaries, with logits equal to a cold
run's, against a real node."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from sessioncache.connector.paged import EngineNode, NodeSettings
from sessioncache.connector.transformers import model_forward
from sessioncache.connector.transformers_hybrid import HybridRunner
from tests.support.servers import Server, start_server

BLOCK = 8
COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 256,
}
CONFIGS: dict[str, dict[str, Any]] = {
    "gemma3": {
        "model_type": "gemma3_text",
        **COMMON,
        "num_hidden_layers": 4,
        "sliding_window": 20,  # a window of three 8-token blocks
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "query_pre_attn_scalar": 32,
    },
    "qwen3-next": {
        "model_type": "qwen3_next",
        **COMMON,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
    "falcon-h1": {
        "model_type": "falcon_h1",
        **COMMON,
        "num_hidden_layers": 2,
        "mamba_d_ssm": 64,
        "mamba_n_heads": 2,
        "mamba_d_head": 32,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_expand": 1,
        "mamba_chunk_size": 8,
    },
}
PROMPT = [int(t) for t in torch.randint(3, 250, (61,), generator=torch.Generator().manual_seed(3))]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("hf-hybrid") / "data", {"SESSIONCACHE_CPU_BYTES": str(256 << 20)}
    )
    yield server
    server.stop()


def random_model(name: str) -> Any:
    config = CONFIGS[name]
    fields = {k: v for k, v in config.items() if k != "model_type"}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(config["model_type"], **fields), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("A_log"):  # a slow decay: a wrong state shows
                param.fill_(math.log(0.01))
    return model


def cold_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    logits, _ = model_forward(model, torch.tensor([tokens]))
    return logits[0]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_resumed_prefixes_give_a_cold_runs_logits(node: Server, name: str):
    model = random_model(name)
    cold = cold_logits(model, PROMPT)
    writer = EngineNode(NodeSettings(node.url, data_path="stream"))
    reader = EngineNode(NodeSettings(node.url, data_path="stream"))
    try:
        a = HybridRunner(
            model, writer, model_id=f"tiny-{name}", block_tokens=BLOCK, checkpoint_blocks=2
        )
        first = a.prefill(PROMPT)
        assert first.cached_tokens == 0
        torch.testing.assert_close(first.logits[0], cold, rtol=1e-4, atol=1e-4)
        assert sorted({c.end for c in first.checkpoints}) == [2, 4, 6, 7]  # stride 2, prompt end
        assert a.save(PROMPT, first) > 0
        b = HybridRunner(
            model, reader, model_id=f"tiny-{name}", block_tokens=BLOCK, checkpoint_blocks=2
        )
        # resumed at several boundaries: a state resumes at a checkpoint only; windows stored
        # at the checkpoints 2, 4, 6 and 7 cover every block, so a window resumes anywhere
        states = any(c.kind == "state" for c in b.hybrid.companions)
        for length in (61, 56, 50, 47, 20, 9):
            usable = (length - 1) // BLOCK
            resumed = max(c for c in (0, 2, 4, 6, 7) if c <= usable) if states else usable
            got = b.prefill(PROMPT[:length])
            assert got.cached_tokens == resumed * BLOCK, (length, got.cached_tokens)
            torch.testing.assert_close(
                got.logits[0], cold[resumed * BLOCK : length], rtol=1e-4, atol=1e-4
            )
        # and decoding goes on from a resumed cache as from a cold one
        got = b.prefill(PROMPT[:56])
        step, _ = model_forward(model, torch.tensor([[PROMPT[56]]]), got.cache)
        torch.testing.assert_close(step[0, -1], cold[56], rtol=1e-4, atol=1e-4)
    finally:
        writer.close()
        reader.close()


def test_a_wrong_state_would_show():
    """The check above can fail: the same resume with the state objects zeroed does not give
    the cold run's logits (the slow decay keeps the state weighing on what follows)."""
    model = random_model("qwen3-next")
    cold = cold_logits(model, PROMPT)
    _, cache = model_forward(model, torch.tensor([PROMPT[:48]]))
    with torch.inference_mode():
        for layer in cache.layers:
            if hasattr(layer, "recurrent_states"):
                layer.recurrent_states[0].zero_()
    logits, _ = model_forward(model, torch.tensor([PROMPT[48:]]), cache)
    assert not torch.allclose(logits[0], cold[48:], rtol=1e-2, atol=1e-2)
