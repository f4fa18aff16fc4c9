"""The vLLM checks that need a GPU host with vLLM's CUDA build (``bench/gpu_check.sh``, section
``vllm``, runs them; skipped anywhere else): MLA models whose backends attend to a cached
context, shared through the node by two fresh engines.

- DeepSeek-V2 layout (the tiny float32 checkpoint of ``test_vllm_exact``, served in float16:
  vLLM's GPU MLA backends take no float32).
- Kimi Linear layout: KDA layers beside MLA (``mla_use_nope``), in ``mamba_cache_mode``
  align, which vLLM's CPU build cannot run (docs/hybrid.md).

Engine A computes the prompt in full, then again from its own prefix cache (vLLM's resume at
the same block boundary as a load's: the reference, computed the same way in the same
precision); a fresh engine B takes the prompt's blocks from the node. B's logprobs are within
1e-3 of A's resume; the changed prompt moves them. Their distance to A's full computation is
printed (float16 rounding, not asserted)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.servers import Server
from tests.vllm.test_vllm_connector import VLLM_PYTHON, engine_process, results
from tests.vllm.test_vllm_exact import (
    CHANGED,
    DEEPSEEK_V2,
    F32_RANDOM,
    MLA_LATENT,
    PROMPT,
    assert_exact,
    ours,
)
from tests.vllm.test_vllm_hybrid import EXACT, random_model


def has_cuda_vllm() -> bool:
    """vLLM's CUDA build in the vLLM environment, on a host with a GPU (asked only there)."""
    if not torch.cuda.is_available() or not VLLM_PYTHON.exists():
        return False
    probe = (
        "import torch, vllm; from vllm.platforms import current_platform as p; print(p.device_type)"
    )
    found = subprocess.run([str(VLLM_PYTHON), "-c", probe], capture_output=True, text=True)
    return found.returncode == 0 and found.stdout.strip().endswith("cuda")


pytestmark = pytest.mark.skipif(not has_cuda_vllm(), reason="needs vLLM's CUDA build on a GPU")

KIMI_LINEAR = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    **MLA_LATENT,
    "mla_use_nope": True,  # Kimi's MLA has no rotary embedding
    "linear_attn_config": {
        "kda_layers": [1, 2, 3],
        "full_attn_layers": [4],
        "num_heads": 4,
        "head_dim": 64,
        "short_conv_kernel_size": 4,
    },
    "num_experts": None,  # dense MLPs (vLLM's config: is_moe is "num_experts is not None")
    "first_k_dense_replace": 4,
    "pad_token_id": 0,
    **F32_RANDOM,
}
MODELS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "deepseek-v2": (DEEPSEEK_V2, {}),
    "kimi-linear": (KIMI_LINEAR, {"mamba_cache_mode": "align"}),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_two_engines_share_an_mla_prefix_on_a_gpu(node: Server, tmp_path: Path, name: str) -> None:
    config, llm = MODELS[name]
    model = random_model(tmp_path / name, config, "float32")
    spec: dict[str, Any] = {
        "load_format": "auto",
        "dtype": "float16",
        "max_tokens": 16,
        "block_size": 64,
        "llm": {**llm, "gpu_memory_utilization": 0.3},
    }
    log: list[str] = []
    session = {"session_id": f"gpu-{name}"}
    full, again, changed = results(
        engine_process(
            model,
            node,
            [
                {"tokens": PROMPT, "params": session},
                {"tokens": PROMPT, "params": session},  # from its own prefix cache
                {"tokens": CHANGED, "cache_salt": "changed"},
            ],
            **spec,
        ),
        "",
        3,
        log,
    )
    assert full["cached"] == 0 and again["cached"] >= 1900, ours(log[0])
    (loaded,) = results(
        engine_process(model, node, [{"tokens": PROMPT, "params": session}], **spec), "", 1, log
    )
    assert loaded["cached"] == again["cached"], ours(log[1])
    assert "sessioncache load:" in log[1] and "loads off" not in log[1], ours(log[1])
    assert assert_exact(loaded, again, changed) <= EXACT
    to_full = max(abs(a - b) for a, b in zip(loaded["logprobs"], full["logprobs"], strict=True))
    print(json.dumps({"model": name, "loaded": loaded["cached"], "to_full_computation": to_full}))
