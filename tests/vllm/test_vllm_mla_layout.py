"""MLA's latent blocks through a real node, byte for byte, with no attention kernel: the paged
cache vLLM's CPU MLA backend allocates for the tiny DeepSeek-V2 of ``test_vllm_exact`` (per
layer ``[num_blocks, 16, 576]``: one latent of ``kv_lora_rank`` 512 + ``qk_rope_head_dim``
64 a token, shared by every head; its engine logs "blocks of 73728 bytes in 2 runs"), saved
by one engine's ``EngineNode`` under the namespace that names the latent layout, loaded by
another into other blocks, and compared. Runs in the dev environment (no vLLM)."""

from __future__ import annotations

import pytest
import torch

from sessioncache.connector.paged import EngineNode, NodeSettings, PagedLayout, Scope, Transfer
from tests.support.servers import Server
from tests.vllm.test_vllm_connector import tokens
from tests.vllm.test_vllm_exact import DEEPSEEK_V2, LLAMA_F32, MLA_BLOCK, MLA_NAMESPACE

BLOCKS = 64


def latent_cache(seed: int) -> dict[str, torch.Tensor]:
    """The two layers' latent caches, float32, random."""
    g = torch.Generator().manual_seed(seed)
    width = DEEPSEEK_V2["kv_lora_rank"] + DEEPSEEK_V2["qk_rope_head_dim"]
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(BLOCKS, MLA_BLOCK, width, generator=g)
        for i in range(DEEPSEEK_V2["num_hidden_layers"])
    }


def bytes_per_token() -> tuple[int, int]:
    """KV bytes per token of the tiny DeepSeek-V2 (one latent per layer) and of a GQA model
    of the same layers, width and heads (the tiny Llama's 2 KV heads of 64), float32."""
    mla = DEEPSEEK_V2["num_hidden_layers"] * (
        DEEPSEEK_V2["kv_lora_rank"] + DEEPSEEK_V2["qk_rope_head_dim"]
    )
    gqa = (
        DEEPSEEK_V2["num_hidden_layers"]
        * 2
        * LLAMA_F32["num_key_value_heads"]
        * LLAMA_F32["head_dim"]
    )
    return mla * 4, gqa * 4


@pytest.mark.parametrize("path", ["same_host", "stream"])
def test_latent_blocks_round_trip_byte_exact(node: Server, path: str) -> None:
    prompt = tokens(32 * MLA_BLOCK, 41 if path == "stream" else 42)
    scope = Scope(session_id=f"mla-{path}")
    saved = latent_cache(seed=1)
    layout = PagedLayout(saved, BLOCKS)
    assert len(layout.runs) == 2 and layout.nbytes == 73728  # as the engine logs it
    src = list(range(40, 8, -1))  # 32 blocks, anywhere in the cache
    alice = EngineNode(NodeSettings(node.url, "sk-a", path, timeout_s=10))
    try:
        alice.open_session(scope)  # as the engine's lookup does
        assert alice.save(MLA_NAMESPACE, Transfer("s", prompt, 0, src, scope), layout) == 32
    finally:
        alice.close()
    loaded = {name: torch.zeros_like(t) for name, t in latent_cache(seed=2).items()}
    dst = list(range(32, 64))
    bob = EngineNode(NodeSettings(node.url, "sk-a", path, timeout_s=10))
    try:
        got = bob.load(
            MLA_NAMESPACE, Transfer("l", prompt, 0, dst, scope), PagedLayout(loaded, BLOCKS)
        )
        assert got.blocks == 32
    finally:
        bob.close()
    for name, tensor in saved.items():
        original = tensor[src].view(torch.uint8)
        assert torch.equal(loaded[name][dst].view(torch.uint8), original)  # byte for byte
        assert not loaded[name][:32].any()  # nothing written past the blocks asked
    mla, gqa = bytes_per_token()
    print(f"KV bytes per token, float32: DeepSeek-V2 layout (MLA) {mla}, GQA of its size {gqa}")
