"""Hugging Face transformers KV caches as sessioncache block payloads, and back.

Layout (``KV_LAYOUT``), one payload per block of ``block_tokens`` tokens::

    for layer in range(num_layers):        # the model's decoder layers, in order
        for kv in (K, V):
            tensor[num_kv_heads, block_tokens, head_dim]   contiguous, C order
                                            # the cache's dtype (the namespace's kv_dtype)

i.e. the bytes of a ``[num_layers, 2, num_kv_heads, block_tokens, head_dim]`` tensor in native
(little-endian) byte order. K is stored as transformers caches it: after the rotary embedding,
so a block is only valid at its own position, which a content-addressed chain guarantees.
A payload holds ``num_layers * 2 * num_kv_heads * block_tokens * head_dim * itemsize`` bytes.

Only batch size 1 and models whose every layer is full attention (no sliding window, no linear
attention state) are supported. Written against transformers 5.x (``Cache.layers[i].keys``,
the ``cache=`` forward argument); 4.x caches (``key_cache``/``value_cache``, ``past_key_values``)
are read through the same helpers.

``CachedPrefixRunner`` is the engine side of one turn: look up the prompt's cached prefix,
load its blocks, run the model on the uncached suffix only, and store the new full blocks.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from sessioncache.connector.client import SessionCacheClient
from sessioncache.connector.errors import LeaseNotFound
from sessioncache.connector.protocol import StoreResult
from sessioncache.connector.transfer import KVTransfer, Transferred
from sessioncache.errors import InvalidInput, PayloadSizeError
from sessioncache.hashing import Namespace

__all__ = [
    "KV_LAYOUT",
    "CachedPrefixRunner",
    "KVShape",
    "Prefill",
    "RoomyLayer",
    "block_payloads_to_kv",
    "cache_layers",
    "kv_dtype_name",
    "kv_to_block_payloads",
    "model_forward",
    "namespace_for",
    "tensor_bytes",
]

KV_LAYOUT = "hf-transformers-v1-[layer][kv][head][tok][dim]"
"""The namespace ``kv_layout`` of the payloads built here (see the module docstring)."""

TRANSFORMERS_VERSION = transformers.__version__

TokenIds = Sequence[int] | npt.NDArray[np.integer[Any]] | torch.Tensor


@dataclass(frozen=True, slots=True)
class KVShape:
    """The per-token KV geometry of a decoder."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config_or_model: Any) -> KVShape:
        """From a ``PretrainedConfig`` or a model (its ``config``)."""
        config = getattr(config_or_model, "config", config_or_model)
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        heads = int(config.num_attention_heads)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            raise InvalidInput(
                f"only full-attention models are supported, this one has layers {layer_types} "
                "(hybrid models: transformers_hybrid.HybridRunner)"
            )
        return cls(int(config.num_hidden_layers), int(kv_heads), int(head_dim))

    def block_bytes(self, block_tokens: int, dtype: torch.dtype) -> int:
        """The size of one block payload."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * block_tokens * self.head_dim * itemsize


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The namespace ``kv_dtype`` of a torch dtype: ``"float32"``, ``"bfloat16"``, ..."""
    return str(dtype).removeprefix("torch.")


def namespace_for(
    model: Any,
    *,
    block_tokens: int,
    model_id: str | None = None,
    dtype: torch.dtype | None = None,
    salt: str | None = None,
    lora: str | None = None,
) -> Namespace:
    """The namespace of ``model``'s KV in this layout. ``model_id`` defaults to the config's
    ``name_or_path``; give one for a model not loaded from a checkpoint (it must name the
    weights: two models with other weights must never share a namespace)."""
    name = model_id or getattr(getattr(model, "config", None), "name_or_path", "") or ""
    if not name:
        raise InvalidInput("the model has no name_or_path: pass model_id")
    kv_dtype = kv_dtype_name(dtype if dtype is not None else _model_dtype(model))
    return Namespace(name, block_tokens, kv_dtype, KV_LAYOUT, salt=salt, lora=lora)


def _model_dtype(model: Any) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return next(iter(model.parameters())).dtype  # type: ignore[no-any-return]


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's ``(keys, values)``, each ``[batch, kv_heads, tokens, head_dim]``, from a
    transformers ``Cache`` (5.x ``layers``, 4.x ``key_cache``) or a legacy tuple of tuples."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        pairs = [(layer.keys, layer.values) for layer in layers]
    elif hasattr(cache, "key_cache"):
        pairs = list(zip(cache.key_cache, cache.value_cache, strict=True))
    else:
        pairs = [(item[0], item[1]) for item in cache]
    for i, (k, v) in enumerate(pairs):
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise InvalidInput(f"layer {i} of the cache holds no tensors")
        if k.dim() != 4 or k.shape != v.shape:
            raise InvalidInput(f"layer {i}: unexpected KV shapes {tuple(k.shape)}/{tuple(v.shape)}")
        if k.shape[0] != 1:
            raise InvalidInput(f"only batch size 1 is supported, got {k.shape[0]}")
    return pairs


def _block_tensor(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], start: int, stop: int
) -> torch.Tensor:
    """``[layers, 2, kv_heads, stop - start, head_dim]`` for tokens ``start:stop``."""
    return torch.stack([torch.stack((k[0, :, start:stop], v[0, :, start:stop])) for k, v in pairs])


def tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())


def block_payload(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], index: int, block_tokens: int
) -> bytes:
    """The payload of block ``index`` from ``cache_layers(cache)``."""
    start, stop = index * block_tokens, (index + 1) * block_tokens
    for i, (k, _) in enumerate(pairs):
        if k.shape[2] < stop:
            raise InvalidInput(
                f"layer {i} holds {k.shape[2]} tokens, block {index} needs {stop} (a sliding "
                "window layer, or a cache shorter than the prompt)"
            )
    return tensor_bytes(_block_tensor(pairs, start, stop))


def kv_to_block_payloads(
    past_key_values: Any,
    block_tokens: int,
    start_block: int = 0,
    end_block: int | None = None,
) -> list[bytes]:
    """Payloads of full blocks ``start_block`` up to ``end_block`` (default: every full block
    the cache holds) of a transformers cache, in ``KV_LAYOUT``."""
    if block_tokens <= 0:
        raise InvalidInput("block_tokens must be positive")
    pairs = cache_layers(past_key_values)
    if not pairs:
        return []
    held = min(k.shape[2] for k, _ in pairs) // block_tokens
    stop = held if end_block is None else end_block
    if not 0 <= start_block <= stop <= held:
        raise InvalidInput(f"blocks {start_block}:{stop} are not within the {held} held")
    return [block_payload(pairs, i, block_tokens) for i in range(start_block, stop)]


def blocks_to_kv(
    blocks: torch.Tensor | Sequence[bytes | bytearray | memoryview],
    config: Any,
    block_tokens: int,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    room: int = 0,
) -> DynamicCache:
    """A ``DynamicCache`` holding the KV of ``blocks``, consecutive blocks from token 0: one
    ``[n, block bytes]`` uint8 tensor on any device (where a data-plane load put them) or a
    sequence of payloads. ``config`` may be the model. Each layer is a ``RoomyLayer`` with
    ``room`` tokens of room past the loaded ones: the uncached suffix and the decode steps
    that follow are written in place up to it. Raises ``PayloadSizeError`` for a payload of
    the wrong size."""
    shape = KVShape.of(config)
    if not isinstance(blocks, torch.Tensor):
        size = shape.block_bytes(block_tokens, dtype)
        for i, p in enumerate(blocks):
            if len(p) != size:
                raise PayloadSizeError(
                    f"block {i} has {len(p)} bytes, {size} expected for {shape} x "
                    f"{block_tokens} tokens of {kv_dtype_name(dtype)}"
                )
        if not blocks:
            return DynamicCache()
        raw = torch.frombuffer(bytearray(b"".join(blocks)), dtype=torch.uint8)
        blocks = raw.view(len(blocks), size)
    n = blocks.shape[0]
    cache = DynamicCache()
    if not n:
        return cache
    heads, dim = shape.num_kv_heads, shape.head_dim
    x = blocks.to(device).reshape(-1).view(dtype)
    x = x.reshape(n, shape.num_layers, 2, heads, block_tokens, dim)
    tokens = n * block_tokens
    for layer in range(shape.num_layers):
        pair = []
        for kv in (0, 1):
            # one transposing copy per tensor, [n, heads, B, dim] -> [heads, n * B, dim],
            # straight into the storage the cache layer keeps
            store = torch.empty((1, heads, tokens + room, dim), dtype=dtype, device=device)
            store[0, :, :tokens].view(heads, n, block_tokens, dim).copy_(
                x[:, layer, kv].transpose(0, 1)
            )
            pair.append(store)
        cache.layers.append(RoomyLayer(pair[0], pair[1], tokens))
    return cache


block_payloads_to_kv = blocks_to_kv
"""``blocks_to_kv`` under the name it first had, for payloads."""


class RoomyLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """A transformers ``DynamicLayer`` over storage with room past its tokens: an update that
    fits (the uncached suffix, then decode steps) is written in place, where ``DynamicLayer``
    concatenates into a fresh tensor, i.e. copies the whole layer on every forward pass (and
    on this kind of host, faults the fresh pages in one by one). An update that does not fit,
    or that follows an operation that replaced the tensors (beam reordering), concatenates."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, tokens: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.room_keys, self.room_values = keys, values
        self.device = keys.device
        self.keys, self.values = keys[:, :, :tokens], values[:, :, :tokens]
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys, self.values
        assert keys is not None and values is not None
        start = keys.shape[-2]
        stop = start + key_states.shape[-2]
        in_place = (
            stop <= self.room_keys.shape[-2]
            and keys.data_ptr() == self.room_keys.data_ptr()
            and values.data_ptr() == self.room_values.data_ptr()
            and key_states.shape[:2] == keys.shape[:2]
            and key_states.dtype == keys.dtype
        )
        if not in_place:
            return super().update(key_states, value_states, *args, **kwargs)  # type: ignore[no-any-return]
        self.room_keys[:, :, start:stop].copy_(key_states)
        self.room_values[:, :, start:stop].copy_(value_states)
        self.keys = self.room_keys[:, :, :stop]
        self.values = self.room_values[:, :, :stop]
        return self.keys, self.values


# -- the engine side of a turn ---------------------------------------------------------------


def _forward_arguments(model: Any, cache: Any | None, last_logits_only: bool) -> dict[str, Any]:
    params = inspect.signature(model.forward).parameters
    # transformers 5 names the cache argument ``cache``; 4.x ``past_key_values``
    kwargs = {"cache" if "cache" in params else "past_key_values": cache}
    if last_logits_only:
        for name in ("logits_to_keep", "num_logits_to_keep"):  # 4.50+, 4.45-4.49
            if name in params:
                kwargs[name] = 1
                break
    return kwargs


def model_forward(
    model: Any, input_ids: torch.Tensor, cache: Any | None = None, *, last_logits_only: bool = False
) -> tuple[torch.Tensor, Any]:
    """``model(input_ids, cache)`` without gradients, across transformers versions: the logits
    ``[1, n, vocab]`` (``[1, 1, vocab]`` with ``last_logits_only``, where the model supports
    it: a prefill that only needs its next token skips the other positions' LM head) and the
    cache (``cache`` extended in place, or a new one)."""
    kwargs = _forward_arguments(model, cache, last_logits_only)
    with torch.inference_mode():
        out = model(input_ids=input_ids, use_cache=True, **kwargs)
    new_cache = getattr(out, "cache", None)
    if new_cache is None:
        new_cache = out.past_key_values
    return out.logits, new_cache


@dataclass
class Prefill:
    """The result of ``CachedPrefixRunner.prefill``."""

    logits: torch.Tensor
    """``[1, computed_tokens, vocab]``: the logits of the uncached suffix's positions (only the
    last one with ``last_logits_only``)."""
    cache: Any
    """The transformers cache holding the KV of every prompt token (extend it by decoding)."""
    cached_tokens: int
    """Prompt tokens whose KV came from sessioncache."""
    computed_tokens: int
    """Prompt tokens the model ran on."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent in ``lookup``, ``load`` (fetch and rebuild) and ``compute``."""


def _as_ids(tokens: TokenIds) -> npt.NDArray[np.int64]:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    ids = np.asarray(tokens)
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise InvalidInput("token ids must be a 1-D sequence of integers (batch size 1)")
    return ids.astype(np.int64)


class CachedPrefixRunner:
    """Runs a transformers causal LM over prompts whose prefix sessioncache may hold.

    ``client.namespace`` must describe ``model``'s KV: ``kv_layout == KV_LAYOUT``, ``kv_dtype``
    the model's dtype (``namespace_for`` builds it). Per turn::

        pre = runner.prefill(prompt, session_id=sid)   # lookup, load, run the suffix only
        ...decode with runner.step(token, pre.cache)...
        runner.save(prompt + generated, pre.cache, session_id=sid)   # upload new full blocks
    """

    def __init__(
        self,
        model: Any,
        client: SessionCacheClient,
        *,
        lease_ms: int = 60_000,
        device: torch.device | str | None = None,
        transfer: KVTransfer | None = None,
        room_tokens: int = 256,
    ) -> None:
        self.model = model
        self.client = client
        self.transfer = transfer
        """Moves the payloads (same host, stream or REST, ``connector.transfer``); without
        one, the REST API does."""
        self.last_load: Transferred | None = None
        self.room_tokens = room_tokens
        """Room a loaded cache keeps past the prompt for decode steps, written in place
        (``RoomyLayer``); past it, the cache grows by concatenation."""
        self.last_store: Transferred | None = None
        self._staging: torch.Tensor | None = None
        self.lease_ms = lease_ms
        self.shape = KVShape.of(model)
        self.dtype = _model_dtype(model)
        self.device = torch.device(device) if device is not None else _model_device(model)
        ns = client.namespace
        if ns.kv_layout != KV_LAYOUT:
            raise InvalidInput(f"the client's kv_layout is {ns.kv_layout!r}, not {KV_LAYOUT!r}")
        model_dtype = kv_dtype_name(self.dtype)
        if ns.kv_dtype != model_dtype:
            raise InvalidInput(
                f"the client's kv_dtype is {ns.kv_dtype!r}, the model's {model_dtype!r}"
            )
        self.block_tokens = ns.block_tokens

    def forward(
        self, input_ids: torch.Tensor, cache: Any | None, *, last_logits_only: bool = False
    ) -> tuple[torch.Tensor, Any]:
        """One forward pass over ``input_ids`` ``[1, n]`` after ``cache``: (logits, cache)."""
        return model_forward(
            self.model, input_ids.to(self.device), cache, last_logits_only=last_logits_only
        )

    def step(self, token: int, cache: Any) -> torch.Tensor:
        """Decode one token after ``cache`` (extended in place): the next-token logits."""
        logits, _ = self.forward(
            torch.tensor([[token]], dtype=torch.long), cache, last_logits_only=True
        )
        return logits[0, -1]

    def prefill(
        self, tokens: TokenIds, *, session_id: str | None = None, last_logits_only: bool = False
    ) -> Prefill:
        """Reuse the longest cached prefix of ``tokens`` (at least one token is always
        computed, for its logits) and run the model on the rest; with ``last_logits_only``
        only the last position's logits are computed (``logits`` is ``[1, 1, vocab]``)."""
        ids = _as_ids(tokens)
        if ids.size == 0:
            raise InvalidInput("an empty prompt")
        timings: dict[str, float] = {}
        clock = time.perf_counter
        t0 = clock()
        if self.transfer is not None:  # the lookup is part of the load (one round trip)
            timings["lookup"] = 0.0
            usable = (len(ids) - 1) // self.block_tokens
            rows = self._load_rows(ids, usable, session_id)
            return self._prefill_with(ids, rows, last_logits_only, timings, t0)
        found = self.client.lookup(ids, session_id=session_id, lease_ms=self.lease_ms)
        t1 = clock()
        timings["lookup"] = t1 - t0
        usable = min(found.matched_blocks, (len(ids) - 1) // self.block_tokens)
        try:
            loaded = self.client.load(found.hashes[:usable]) if usable else []
        finally:
            if found.lease is not None:
                self._release(found.lease.id)
        payloads: list[bytes] = []
        for p in loaded:  # a block gone despite the lease: reuse what precedes it
            if p is None:
                break
            payloads.append(p)
        return self._prefill_with(ids, payloads, last_logits_only, timings, t1)

    def _load_rows(
        self, ids: npt.NDArray[np.int64], usable: int, session_id: str | None
    ) -> torch.Tensor:
        """The cached blocks among the first ``usable`` of ``ids``, loaded through
        ``self.transfer`` into one tensor of rows (``self.last_load`` tells the load)."""
        assert self.transfer is not None
        buf = self._staging_rows(usable)
        got = self.transfer.load_into(
            ids[: usable * self.block_tokens], list(buf), session_id=session_id
        )
        self.last_load = got
        return buf[: got.blocks]

    def _prefill_with(
        self,
        ids: npt.NDArray[np.int64],
        blocks: torch.Tensor | list[bytes],
        last_logits_only: bool,
        timings: dict[str, float],
        t1: float,
    ) -> Prefill:
        """``prefill`` once ``blocks`` (the first of ``ids``, loaded since ``t1``) are here: the
        model run on the tokens past them, over their KV."""
        n = len(blocks)
        cache = (
            blocks_to_kv(
                blocks,
                self.model,
                self.block_tokens,
                device=self.device,
                dtype=self.dtype,
                room=len(ids) - n * self.block_tokens + self.room_tokens,
            )
            if n
            else None
        )
        t2 = time.perf_counter()
        timings["load"] = t2 - t1
        cached = n * self.block_tokens
        suffix = torch.from_numpy(ids[cached:]).unsqueeze(0)
        logits, cache = self.forward(suffix, cache, last_logits_only=last_logits_only)
        timings["compute"] = time.perf_counter() - t2
        return Prefill(logits, cache, cached, len(ids) - cached, timings)

    def _staging_rows(self, n: int) -> torch.Tensor:
        """``n`` block-sized rows to load into, kept from turn to turn: a fresh host buffer
        would be faulted in page by page during the copy (64 MiB: ~16K faults), every turn.
        On a CUDA device the rows are device memory, which the carriers copy into straight
        from the node's (registered) shared memory or their pinned buffers. ``blocks_to_kv``
        copies out of them, so the next turn may overwrite them."""
        size = self.shape.block_bytes(self.block_tokens, self.dtype)
        if self._staging is None or self._staging.shape[0] < n:
            device = self.device if self.device.type == "cuda" else torch.device("cpu")
            self._staging = torch.empty((n, size), dtype=torch.uint8, device=device)
        return self._staging[:n]

    def save(
        self,
        tokens: TokenIds,
        cache: Any,
        *,
        session_id: str | None = None,
        ttl_s: float | None = None,
    ) -> StoreResult | Transferred:
        """Store the full blocks of ``tokens`` whose KV ``cache`` holds (from token 0); only the
        blocks the service lacks are serialized and uploaded (with a ``transfer``: those past
        the cached prefix, over its path)."""
        ids = _as_ids(tokens)
        pairs = cache_layers(cache)
        if self.transfer is not None:
            full = min(len(ids), min(k.shape[2] for k, _ in pairs)) // self.block_tokens
            held = self.client.lookup_by_id(ids[: full * self.block_tokens]).matched_blocks
            # Each block's bytes where the cache lies (on a device, the carrier copies them
            # out on the device's copy stream, complete before they are committed).
            blocks = [
                _block_tensor(pairs, i * self.block_tokens, (i + 1) * self.block_tokens)
                .contiguous()
                .reshape(-1)
                .view(torch.uint8)
                for i in range(held, full)
            ]
            got = self.transfer.store_from(
                ids, blocks, session_id=session_id, ttl_s=ttl_s, first_block=held
            )
            self.last_store = got
            return got
        provider: Callable[[int], bytes] = lambda i: block_payload(pairs, i, self.block_tokens)  # noqa: E731
        return self.client.store(ids, provider, session_id=session_id, ttl_s=ttl_s)

    def _release(self, lease_id: str) -> None:
        with contextlib.suppress(LeaseNotFound):  # expired already: nothing to give back
            self.client.release(lease_id)


def _model_device(model: Any) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(iter(model.parameters())).device  # type: ignore[no-any-return]
