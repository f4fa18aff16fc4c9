"""transformers KV caches as block payloads, and a multi-turn session through the real service
whose logits with the reused prefix equal a full recompute."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from sessioncache.connector import SessionCacheClient
from sessioncache.connector.transfer import KVTransfer, Transferred
from sessioncache.connector.transformers import (
    KV_LAYOUT,
    CachedPrefixRunner,
    KVShape,
    RoomyLayer,
    block_payloads_to_kv,
    cache_layers,
    kv_to_block_payloads,
    model_forward,
    namespace_for,
)
from sessioncache.errors import InvalidInput, PayloadSizeError
from tests.support.models import tiny_llama
from tests.support.servers import Server, start_server

B = 16
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama()


def full_forward(model: Any, ids: list[int]) -> tuple[torch.Tensor, Any]:
    return model_forward(model, torch.tensor([ids]))


def test_payload_layout_and_round_trip(model: Any) -> None:
    shape = KVShape.of(model)
    assert shape == KVShape(num_layers=2, num_kv_heads=2, head_dim=16)
    ids = list(range(3, 3 + 2 * B + 5))
    _, cache = full_forward(model, ids)
    pairs = cache_layers(cache)
    payloads = kv_to_block_payloads(cache, B)
    assert len(payloads) == 2
    assert all(
        len(p) == shape.block_bytes(B, torch.float32) == 2 * 2 * 2 * B * 16 * 4 for p in payloads
    )
    # [layer][kv][head][tok][dim]
    block1 = torch.frombuffer(bytearray(payloads[1]), dtype=torch.float32).reshape(2, 2, 2, B, 16)
    for layer, (k, v) in enumerate(pairs):
        assert torch.equal(block1[layer, 0], k[0, :, B : 2 * B])
        assert torch.equal(block1[layer, 1], v[0, :, B : 2 * B])
    assert kv_to_block_payloads(cache, B, start_block=1) == payloads[1:]
    rebuilt = block_payloads_to_kv(payloads, model.config, B)
    for (k, v), (k2, v2) in zip(pairs, cache_layers(rebuilt), strict=True):
        assert k2.is_contiguous() and torch.equal(k[:, :, : 2 * B], k2)
        assert torch.equal(v[:, :, : 2 * B], v2)
    assert rebuilt.get_seq_length() == 2 * B
    with pytest.raises(PayloadSizeError):
        block_payloads_to_kv([payloads[0][:-4]], model, B)
    with pytest.raises(InvalidInput):
        kv_to_block_payloads(cache, B, start_block=0, end_block=3)


def test_a_loaded_cache_grows_in_place_then_by_concatenation(model: Any) -> None:
    ids = [int(t) for t in torch.randint(0, 256, (2 * B + 6,), generator=torch.Generator())]
    _, cache = full_forward(model, ids[: 2 * B])
    payloads = kv_to_block_payloads(cache, B)
    loaded = block_payloads_to_kv(payloads, model, B, room=3)
    layer = loaded.layers[0]
    assert isinstance(layer, RoomyLayer) and layer.room_keys.shape[-2] == 2 * B + 3
    logits, loaded = model_forward(model, torch.tensor([ids[2 * B : 2 * B + 3]]), loaded)
    assert loaded.layers[0].keys.data_ptr() == layer.room_keys.data_ptr()  # in place
    full, _ = full_forward(model, ids[: 2 * B + 3])
    assert (logits[0] - full[0, 2 * B :]).abs().max().item() <= TOLERANCE
    # past the room: the layer concatenates, as a DynamicLayer does
    logits, loaded = model_forward(model, torch.tensor([ids[2 * B + 3 :]]), loaded)
    assert loaded.layers[0].keys.data_ptr() != layer.room_keys.data_ptr()
    assert loaded.get_seq_length() == len(ids)
    full, _ = full_forward(model, ids)
    assert (logits[0] - full[0, 2 * B + 3 :]).abs().max().item() <= TOLERANCE


def test_runner_checks_the_namespace(model: Any, open_server: Server) -> None:
    ns = namespace_for(model, block_tokens=B, model_id="tiny")
    assert (ns.kv_layout, ns.kv_dtype) == (KV_LAYOUT, "float32")
    with pytest.raises(InvalidInput):
        namespace_for(model, block_tokens=B)  # a random model has no name: say which
    for bad in (
        namespace_for(model, block_tokens=B, model_id="tiny", dtype=torch.bfloat16),
        ns.__class__("tiny", B, "float32", "vllm-nhd-v1"),
    ):
        with SessionCacheClient(open_server.url, namespace=bad) as c, pytest.raises(InvalidInput):
            CachedPrefixRunner(model, c)


def test_multi_turn_reuse_equals_full_recompute(model: Any, open_server: Server) -> None:
    gen = torch.Generator().manual_seed(1)

    def fresh(n: int) -> list[int]:
        return [int(t) for t in torch.randint(0, 256, (n,), generator=gen)]

    ns = namespace_for(model, block_tokens=B, model_id="test/tiny-llama-random-seed0")
    worst = 0.0
    with SessionCacheClient(open_server.url, namespace=ns) as client:
        runner = CachedPrefixRunner(model, client)
        session = client.open_session(kind="agent")
        history = fresh(50)  # the system prompt
        reused = []
        for turn in range(3):
            prompt = history + fresh(20 + 3 * turn)  # the next user message
            pre = runner.prefill(prompt, session_id=session.id)
            reused.append(pre.cached_tokens)
            assert pre.cached_tokens + pre.computed_tokens == len(prompt)
            full_logits, _ = full_forward(model, prompt)
            diff = (pre.logits[0] - full_logits[0, pre.cached_tokens :]).abs().max().item()
            worst = max(worst, diff)
            # decode a few tokens greedily, extending the cache, then store the whole turn
            generated = [int(pre.logits[0, -1].argmax())]
            for _ in range(4):
                generated.append(int(runner.step(generated[-1], pre.cache).argmax()))
            history = prompt + generated
            full_logits, _ = full_forward(model, history[:-1])
            assert generated[-1] == int(full_logits[0, -1].argmax())
            stored = runner.save(history[:-1], pre.cache, session_id=session.id)
            assert stored.stored == len(stored.missing)
        client.close_session(session.id)

        # the check has teeth: one wrong block gives other logits (a permutation of the blocks
        # would not: attention over a set of RoPE'd keys does not depend on their order)
        prompt = history[: 4 * B + 10]
        blocks = client.load(client.lookup(prompt).hashes[:4])
        assert all(b is not None for b in blocks)
        wrong = [blocks[0], blocks[0], blocks[2], blocks[3]]
        cache = block_payloads_to_kv(wrong, model, B)  # type: ignore[arg-type]
        logits, _ = model_forward(model, torch.tensor([prompt[4 * B :]]), cache)
        full_logits, _ = full_forward(model, prompt)
        control = (logits[0] - full_logits[0, 4 * B :]).abs().max().item()
        assert control > 1e-2
    print(
        f"\nmax abs logit diff with the reused prefix: {worst:.3g} (one wrong block: {control:.3g})"
    )
    assert reused[0] == 0 and reused[1] >= 4 * B and reused[2] > reused[1]
    assert worst <= TOLERANCE


@pytest.fixture(scope="module")
def own_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A node of its own: the shared one's CPU tier may be full of other tests' pinned blocks,
    and a same-host store needs room in that tier."""
    server = start_server(tmp_path_factory.mktemp("transformers-paths") / "data")
    yield server
    server.stop()


@pytest.mark.parametrize("path", ["same_host", "stream", "rest"])
def test_reuse_through_each_data_path_equals_full_recompute(
    model: Any, own_server: Server, path: str
) -> None:
    open_server = own_server
    gen = torch.Generator().manual_seed(7)
    prompt = [int(t) for t in torch.randint(0, 256, (3 * B + 5,), generator=gen)]
    ns = namespace_for(model, block_tokens=B, model_id=f"test/tiny-llama-{path}")
    with (
        SessionCacheClient(open_server.url, namespace=ns) as client,
        KVTransfer(client, path=path) as kv,  # type: ignore[arg-type]
    ):
        runner = CachedPrefixRunner(model, client, transfer=kv)
        first = runner.prefill(prompt)
        assert first.cached_tokens == 0
        saved = runner.save(prompt, first.cache)
        assert isinstance(saved, Transferred) and saved.path == path and saved.blocks == 3
        again = runner.prefill(prompt)
        assert again.cached_tokens == 3 * B
        assert runner.last_load is not None and runner.last_load.path == path
        full_logits, _ = full_forward(model, prompt)
        diff = (again.logits[0] - full_logits[0, again.cached_tokens :]).abs().max().item()
        assert diff <= TOLERANCE
        # A longer prompt stores only its new blocks, after the 3 held ones.
        longer = prompt + [int(t) for t in torch.randint(0, 256, (B,), generator=gen)]
        grown = runner.prefill(longer)
        assert grown.cached_tokens == 3 * B
        assert runner.save(longer, grown.cache).blocks == 1  # type: ignore[union-attr]
