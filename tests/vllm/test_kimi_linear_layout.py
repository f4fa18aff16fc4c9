"""Kimi Linear's layout through the node, in transformers (vLLM's CPU build cannot run Kimi
Linear: docs/hybrid.md): three KDA layers (Kimi Delta Attention: a short convolution, then a
delta-rule recurrent state decayed per key channel) to one MLA layer (one latent a token,
shared by the heads, no rotary embedding: ``mla_use_nope``), in a model class written here.

``HybridRunner`` stores the MLA layer's latents as the spine (the 48-wide latent of each token
split in halves over the cache layer's K and V) and the KDA layers' convolution and recurrent
states as checkpoints at block boundaries, hung off it. A second runner resumes prompts at
each held checkpoint with the logits of a cold run (float32, 1e-4); the same resume with the
states zeroed does not give them."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PretrainedConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from sessioncache.connector.paged import EngineNode, NodeSettings
from sessioncache.connector.transformers import model_forward
from sessioncache.connector.transformers_hybrid import HybridRunner
from tests.support.servers import Server

BLOCK = 8
HIDDEN, HEADS, KEY, VALUE, KERNEL = 64, 2, 16, 16, 4
LATENT, ROPE, NOPE = 32, 16, 16
"""The MLA latent: ``kv_lora_rank`` 32 + ``qk_rope_head_dim`` 16 (unrotated), per-head query
and key parts of 16."""
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]
PROMPT = [int(t) for t in torch.randint(3, 250, (61,), generator=torch.Generator().manual_seed(5))]


class KimiLayoutConfig(PretrainedConfig):  # type: ignore[misc]
    model_type = "kimi-layout-test"

    def __init__(self, **kwargs: Any) -> None:
        self.layer_types = LAYER_TYPES
        self.num_hidden_layers = len(LAYER_TYPES)
        self.hidden_size = HIDDEN
        self.vocab_size = 256
        super().__init__(**kwargs)


class KDA(nn.Module):
    """Kimi Delta Attention, token by token: ``S = diag(exp(g)) S``, then the delta rule
    ``S += beta k (v - S^T k)^T``, output ``S^T q``; q, k, v through a causal depthwise
    convolution whose last ``KERNEL`` inputs the cache keeps."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.qkv = nn.Linear(HIDDEN, HEADS * (2 * KEY + VALUE), bias=False)
        self.conv = nn.Conv1d(
            HEADS * (2 * KEY + VALUE),
            HEADS * (2 * KEY + VALUE),
            KERNEL,
            groups=HEADS * (2 * KEY + VALUE),
            bias=False,
        )
        self.gate = nn.Linear(HIDDEN, HEADS * KEY)
        self.beta = nn.Linear(HIDDEN, HEADS)
        self.out = nn.Linear(HEADS * VALUE, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        layer = cache.layers[self.index]
        resumed = bool(layer.has_previous_state[0])
        mixed = self.qkv(x).transpose(1, 2)  # [1, C, T]
        steps = mixed.shape[-1]
        full = layer.update_conv_state(mixed, conv_kernel_size=KERNEL)
        # resumed: the kept inputs, then these (the last KERNEL - 1 + T feed the outputs)
        inputs = full[..., -(KERNEL - 1 + steps) :] if resumed else F.pad(mixed, (KERNEL - 1, 0))
        mixed = F.silu(self.conv(inputs)).transpose(1, 2)[0]  # [T, C]
        q, k, v = mixed.split([HEADS * KEY, HEADS * KEY, HEADS * VALUE], dim=-1)
        q = F.normalize(q.view(steps, HEADS, KEY), dim=-1)
        k = F.normalize(k.view(steps, HEADS, KEY), dim=-1)
        v = v.view(steps, HEADS, VALUE)
        decay = torch.exp(-F.softplus(self.gate(x[0])).view(steps, HEADS, KEY) * 0.05)
        beta = torch.sigmoid(self.beta(x[0]))
        if layer.is_recurrent_states_initialized[0]:
            state = layer.recurrent_states[0][0].clone()
        else:
            state = x.new_zeros(HEADS, KEY, VALUE)
        outs = []
        for t in range(steps):
            state = state * decay[t].unsqueeze(-1)
            error = v[t] - torch.einsum("hk,hkv->hv", k[t], state)
            state = state + beta[t].view(HEADS, 1, 1) * k[t].unsqueeze(-1) * error.unsqueeze(1)
            outs.append(torch.einsum("hk,hkv->hv", q[t], state))
        layer.update_recurrent_state(state.unsqueeze(0))
        return self.out(torch.stack(outs).reshape(1, steps, HEADS * VALUE))


class MLA(nn.Module):
    """Multi-head latent attention without rotary embedding (``mla_use_nope``): the cache keeps
    each token's latent (``LATENT + ROPE`` values, the layout vLLM's MLA backends page); each
    head's keys and values are projected up from it."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.down = nn.Linear(HIDDEN, LATENT + ROPE, bias=False)
        self.norm = nn.RMSNorm(LATENT)
        self.q = nn.Linear(HIDDEN, HEADS * (NOPE + ROPE), bias=False)
        self.up_k = nn.Linear(LATENT, HEADS * NOPE, bias=False)
        self.up_v = nn.Linear(LATENT, HEADS * VALUE, bias=False)
        self.out = nn.Linear(HEADS * VALUE, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        steps = x.shape[1]
        latent, shared = self.down(x).split([LATENT, ROPE], dim=-1)
        whole = torch.cat([self.norm(latent), shared], dim=-1)  # [1, T, 48]
        half = (LATENT + ROPE) // 2
        keys, values = cache.update(
            whole[..., :half].unsqueeze(1), whole[..., half:].unsqueeze(1), self.index
        )
        past = torch.cat([keys, values], dim=-1)[0, 0]  # [P + T, 48]
        latent, shared = past.split([LATENT, ROPE], dim=-1)
        total = past.shape[0]
        k_nope = self.up_k(latent).view(total, HEADS, NOPE)
        k = torch.cat([k_nope, shared.unsqueeze(1).expand(total, HEADS, ROPE)], dim=-1)
        v = self.up_v(latent).view(total, HEADS, VALUE)
        q = self.q(x[0]).view(steps, HEADS, NOPE + ROPE)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=torch.ones(steps, total, dtype=torch.bool).tril(total - steps),
        )
        return self.out(out.transpose(0, 1).reshape(1, steps, HEADS * VALUE))


class KimiLayoutModel(nn.Module):
    """Embedding, the four mixers with pre-norm residuals, an LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.config = KimiLayoutConfig()
        self.embed = nn.Embedding(256, HIDDEN)
        self.mixers = nn.ModuleList(
            KDA(i) if kind == "linear_attention" else MLA(i) for i, kind in enumerate(LAYER_TYPES)
        )
        self.norms = nn.ModuleList(nn.RMSNorm(HIDDEN) for _ in LAYER_TYPES)
        self.head = nn.Linear(HIDDEN, 256, bias=False)

    def forward(
        self, input_ids: torch.Tensor, past_key_values: Any = None, **kwargs: Any
    ) -> CausalLMOutputWithPast:
        cache = past_key_values if past_key_values is not None else DynamicCache(config=self.config)
        x = self.embed(input_ids)
        for norm, mixer in zip(self.norms, self.mixers, strict=True):
            x = x + mixer(norm(x), cache)
        return CausalLMOutputWithPast(logits=self.head(x), past_key_values=cache)


def kimi_model() -> KimiLayoutModel:
    torch.manual_seed(0)
    model = KimiLayoutModel().eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.1)
    return model


def test_kimi_linear_layout_resumes_at_its_checkpoints(node: Server) -> None:
    model = kimi_model()
    cold, _ = model_forward(model, torch.tensor([PROMPT]))
    writer = EngineNode(NodeSettings(node.url, "sk-a", "stream"))
    reader = EngineNode(NodeSettings(node.url, "sk-a", "stream"))
    try:
        a = HybridRunner(
            model, writer, model_id="tiny-kimi", block_tokens=BLOCK, checkpoint_blocks=2
        )
        assert a.kinds.full == (3,) and a.kinds.linear == (0, 1, 2)  # the MLA spine, KDA states
        assert a.spine_bytes == BLOCK * (LATENT + ROPE) * 4  # one latent a token, float32
        first = a.prefill(PROMPT)
        torch.testing.assert_close(first.logits[0], cold[0], rtol=1e-4, atol=1e-4)
        assert sorted({c.end for c in first.checkpoints}) == [2, 4, 6, 7]
        assert a.save(PROMPT, first) > 0
        b = HybridRunner(
            model, reader, model_id="tiny-kimi", block_tokens=BLOCK, checkpoint_blocks=2
        )
        for length in (61, 50, 40, 20):
            usable = (length - 1) // BLOCK
            resumed = max(c for c in (0, 2, 4, 6, 7) if c <= usable)
            got = b.prefill(PROMPT[:length])
            assert got.cached_tokens == resumed * BLOCK, (length, got.cached_tokens)
            torch.testing.assert_close(
                got.logits[0], cold[0, resumed * BLOCK : length], rtol=1e-4, atol=1e-4
            )
        got = b.prefill(PROMPT[:56])  # and decoding goes on from the resumed cache
        step, _ = model_forward(model, torch.tensor([[PROMPT[56]]]), got.cache)
        torch.testing.assert_close(step[0, -1], cold[0, 56], rtol=1e-4, atol=1e-4)
    finally:
        writer.close()
        reader.close()
    # the check can fail: the states zeroed at the resume point move the logits
    _, cache = model_forward(model, torch.tensor([PROMPT[:48]]))
    with torch.inference_mode():
        for layer in cache.layers:
            if hasattr(layer, "recurrent_states"):
                layer.recurrent_states[0].zero_()
    wrong, _ = model_forward(model, torch.tensor([PROMPT[48:]]), cache)
    assert not torch.allclose(wrong[0], cold[0, 48:], rtol=1e-2, atol=1e-2)
