"""Small transformers models with random weights, for the tests that run a real model."""

from __future__ import annotations

from typing import Any

import torch
import transformers


def tiny_llama(device: torch.device | str = "cpu") -> Any:
    """A 2-layer Llama (vocab 256, 2 KV heads of 16), float32, seeded: the same weights on
    every call."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return transformers.LlamaForCausalLM(config).to(torch.float32).to(device).eval()
