"""``CachedPrefixRunner`` with its model on the device: a prefix loaded from the node over
each data path, straight into device memory, gives the logits of a cold run."""

from __future__ import annotations

import pytest
import torch

from sessioncache.connector import SessionCacheClient
from sessioncache.connector.transfer import KVTransfer, Transferred
from sessioncache.connector.transformers import CachedPrefixRunner, model_forward, namespace_for
from tests.support.models import tiny_llama
from tests.support.servers import Server

B = 16


@pytest.mark.parametrize("path", ["same_host", "stream", "rest"])
def test_a_cached_prefix_on_the_device_gives_the_cold_runs_logits(
    node: Server, device: torch.device, path: str
) -> None:
    model = tiny_llama(device)
    gen = torch.Generator().manual_seed(11)
    prompt = [int(t) for t in torch.randint(0, 256, (4 * B + 3,), generator=gen)]
    ns = namespace_for(model, block_tokens=B, model_id=f"test/gpu-llama-{path}-{device.type}")
    with (
        SessionCacheClient(node.url, namespace=ns, api_key="key-acme") as client,
        KVTransfer(client, path=path) as kv,  # type: ignore[arg-type]
    ):
        runner = CachedPrefixRunner(model, client, transfer=kv)
        assert runner.device.type == device.type
        cold = runner.prefill(prompt)
        assert cold.cached_tokens == 0
        saved = runner.save(prompt, cold.cache)  # blocks copied off the device
        assert isinstance(saved, Transferred) and saved.path == path and saved.blocks == 4
        warm = runner.prefill(prompt)
        assert warm.cached_tokens == 4 * B
        assert warm.logits.device.type == device.type
        full, _ = model_forward(model, torch.tensor([prompt], device=device))
        diff = (warm.logits[0] - full[0, warm.cached_tokens :]).abs().max().item()
        assert diff <= (1e-4 if device.type == "cpu" else 1e-3), diff
        # a decode step after the loaded prefix matches the cold cache's
        token = int(full[0, -1].argmax())
        step_warm = runner.step(token, warm.cache)
        step_cold = runner.step(token, cold.cache)
        assert (step_warm - step_cold).abs().max().item() <= 1e-3
