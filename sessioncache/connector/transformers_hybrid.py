"""Hybrid transformers models (sliding-window, linear-attention or Mamba layers beside full
attention: Gemma 3, Qwen3-Next, Falcon-H1, ...) resumed from a cached prefix, over the data
plane (``connector.hybrid``; docs/hybrid.md).

transformers 5 keeps each layer's past in a layer of its ``DynamicCache``: a ``DynamicLayer``
(full attention: every token's K and V), a ``DynamicSlidingWindowLayer`` (the last
``sliding_window - 1`` tokens), a ``LinearAttentionLayer`` (a convolution state and a
recurrent state), or both of the last and the first (Falcon-H1). ``HybridRunner`` stores:

- the spine: per block, the K and V of every full-attention layer (``[heads, block, dim]``
  each, layers in order);
- a window object per block a checkpoint's window covers: the same of every sliding layer;
- a state object per checkpoint: every linear layer's convolution and recurrent state at
  that block boundary, as the model holds them.

A prefill resumes at the longest held checkpoint, and runs the rest in pieces that end at the
checkpoints to come (the stride, the end of the prompt), whose objects it captures on the way;
``save`` stores the spine and them. Batch size 1. Written against transformers 5.24 and 5.25
(5.25's linear layers count their tokens), whose ``DynamicCache`` holds every model's layers
in these classes; a layer of any other class is refused (``LayerKinds.of``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from sessioncache.connector.hybrid import (
    DEFAULT_CHECKPOINT_BLOCKS,
    Checkpoint,
    GroupSpec,
    HybridLoad,
    HybridModel,
    HybridNode,
    is_checkpoint,
)
from sessioncache.connector.paged import BlockBytes, EngineNode, Scope, Transfer
from sessioncache.connector.transformers import kv_dtype_name, model_forward, tensor_bytes
from sessioncache.errors import InvalidInput
from sessioncache.hashing import Namespace

KV_LAYOUT = "hf-transformers-hybrid-v1"
"""The namespace ``kv_layout`` of ``HybridRunner``'s objects (module docstring)."""


def _bytes(t: torch.Tensor) -> BlockBytes:
    return np.frombuffer(tensor_bytes(t), np.uint8)


class HostBlocks:
    """Blocks in host memory by position: what a load fills and a save reads (a
    ``paged.BlockCopier`` whose targets are positions)."""

    device = torch.device("cpu")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.rows: dict[int, BlockBytes] = {}

    def scatter(self, targets: Sequence[Any], sources: Sequence[BlockBytes]) -> None:
        for target, source in zip(targets, sources, strict=True):
            self.rows[int(target)] = np.array(source, dtype=np.uint8, copy=True)

    def gather(self, targets: Sequence[Any], out: Sequence[BlockBytes]) -> None:
        for target, dst in zip(targets, out, strict=True):
            dst[:] = self.rows[int(target)]


@dataclass(frozen=True, slots=True)
class LayerKinds:
    """Which layers of a model's ``DynamicCache`` hold what (learned from a probe)."""

    full: tuple[int, ...]
    sliding: tuple[int, ...]
    linear: tuple[int, ...]
    sliding_window: int
    kv_shapes: dict[int, tuple[int, int]]
    """Heads and head dim of each attention layer."""
    states: dict[int, tuple[torch.Size, torch.dtype, torch.Size, torch.dtype]]
    """Convolution and recurrent state shape and dtype of each linear layer."""

    @classmethod
    def of(cls, cache: Any) -> LayerKinds:
        full, sliding, linear = [], [], []
        window = 0
        kv: dict[int, tuple[int, int]] = {}
        states: dict[int, tuple[torch.Size, torch.dtype, torch.Size, torch.dtype]] = {}
        for i, layer in enumerate(cache.layers):
            if isinstance(layer, DynamicSlidingWindowLayer):
                sliding.append(i)
                window = layer.sliding_window
            elif isinstance(layer, DynamicLayer):
                full.append(i)
            if isinstance(layer, DynamicLayer):
                if layer.keys is None or layer.keys.dim() != 4 or layer.keys.shape[0] != 1:
                    raise InvalidInput(f"layer {i}: no K/V of batch size 1")
                kv[i] = (int(layer.keys.shape[1]), int(layer.keys.shape[3]))
            if hasattr(layer, "conv_states"):
                if layer.number_of_states != 1:
                    raise InvalidInput(f"layer {i}: {layer.number_of_states} states per layer")
                conv, rec = layer.conv_states[0], layer.recurrent_states[0]
                if conv is None or rec is None:
                    raise InvalidInput(f"layer {i}: a linear layer without its states")
                linear.append(i)
                states[i] = (conv.shape, conv.dtype, rec.shape, rec.dtype)
            elif not isinstance(layer, DynamicLayer):
                raise InvalidInput(f"layer {i}: a {type(layer).__name__} is not stored")
        if not full:
            raise InvalidInput("no full-attention layer to chain the others to")
        return cls(tuple(full), tuple(sliding), tuple(linear), window, kv, states)

    def kv_bytes(self, layers: Sequence[int], tokens: int, itemsize: int) -> int:
        return sum(
            2 * self.kv_shapes[i][0] * tokens * self.kv_shapes[i][1] * itemsize for i in layers
        )

    def state_bytes(self) -> int:
        total = 0
        for conv, conv_dtype, rec, rec_dtype in self.states.values():
            total += conv.numel() * conv_dtype.itemsize + rec.numel() * rec_dtype.itemsize
        return total


@dataclass
class HybridPrefill:
    """What ``HybridRunner.prefill`` did."""

    logits: torch.Tensor
    """``[1, computed_tokens, vocab]``."""
    cache: Any
    cached_tokens: int
    computed_tokens: int
    checkpoints: list[Checkpoint] = field(default_factory=list)
    """The window and state objects captured on the way, for ``save``."""
    timings: dict[str, float] = field(default_factory=dict)


class HybridRunner:
    """Runs a hybrid transformers model over prompts whose prefix the node may hold (module
    docstring): ``prefill`` resumes and captures, ``save`` stores."""

    def __init__(
        self,
        model: Any,
        node: EngineNode,
        *,
        model_id: str,
        block_tokens: int,
        salt: str | None = None,
        checkpoint_blocks: int = DEFAULT_CHECKPOINT_BLOCKS,
        scope: Scope | None = None,
    ) -> None:
        self.model = model
        self.node = node
        self.block_tokens = block_tokens
        self.stride = checkpoint_blocks
        self.scope = scope or Scope()
        self.dtype = next(iter(model.parameters())).dtype
        self.device = next(iter(model.parameters())).device
        probe = torch.zeros((1, block_tokens), dtype=torch.long, device=self.device)
        _, cache = model_forward(model, probe, DynamicCache(config=model.config))
        kinds = self.kinds = LayerKinds.of(cache)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        window = -(-(kinds.sliding_window - 1) // block_tokens) if kinds.sliding else 0
        companions = []
        if kinds.sliding:
            companions.append(GroupSpec("window", tuple(map(str, kinds.sliding)), max(1, window)))
        if kinds.linear:
            companions.append(GroupSpec("state", tuple(map(str, kinds.linear))))
        self.hybrid = HybridModel(GroupSpec("full", tuple(map(str, kinds.full))), tuple(companions))
        self.ops = HybridNode(node, self.hybrid)
        self.spine_bytes = kinds.kv_bytes(kinds.full, block_tokens, itemsize)
        self.companion_bytes = [
            kinds.kv_bytes(kinds.sliding, block_tokens, itemsize)
            if c.kind == "window"
            else kinds.state_bytes()
            for c in companions
        ]
        self.namespace = Namespace(
            model_id, block_tokens, kv_dtype_name(self.dtype), KV_LAYOUT, salt=salt
        )

    # -- a cache from objects, and objects from a cache ------------------------------------

    def _kv_of(self, layers: Sequence[int], rows: Sequence[BlockBytes]) -> dict[int, torch.Tensor]:
        """Each layer's ``[2, heads, len(rows) * B, dim]`` K/V from block payloads."""
        bs = self.block_tokens
        out: dict[int, torch.Tensor] = {}
        data = torch.from_numpy(np.stack(rows)).view(self.dtype)  # [n, elements]
        offset = 0
        for i in layers:
            heads, dim = self.kinds.kv_shapes[i]
            size = 2 * heads * bs * dim
            part = data[:, offset : offset + size].reshape(len(rows), 2, heads, bs, dim)
            out[i] = part.permute(1, 2, 0, 3, 4).reshape(2, heads, len(rows) * bs, dim)
            offset += size
        return out

    def _block(self, cache: Any, layers: Sequence[int], position: int) -> BlockBytes:
        """The payload of block ``position`` of ``layers`` (K/V of its tokens)."""
        bs = self.block_tokens
        parts = []
        for i in layers:
            layer = cache.layers[i]
            start = layer.cumulative_length - layer.keys.shape[2] if i in self.kinds.sliding else 0
            lo = position * bs - start
            if lo < 0 or lo + bs > layer.keys.shape[2]:
                raise InvalidInput(f"layer {i} does not hold block {position}")
            parts += [layer.keys[0, :, lo : lo + bs], layer.values[0, :, lo : lo + bs]]
        return _bytes(torch.stack(parts) if len(parts) > 1 else parts[0])

    def _state(self, cache: Any) -> BlockBytes:
        parts = []
        for i in self.kinds.linear:
            layer = cache.layers[i]
            parts += [_bytes(layer.conv_states[0]), _bytes(layer.recurrent_states[0])]
        return np.concatenate(parts)

    def _cache(
        self, spine: list[BlockBytes], window: list[BlockBytes], state: BlockBytes | None
    ) -> Any:
        """A ``DynamicCache`` resumed at ``len(spine)`` blocks."""
        cache: Any = DynamicCache(config=self.model.config)
        tokens = len(spine) * self.block_tokens
        for i, kv in self._kv_of(self.kinds.full, spine).items():
            layer = cache.layers[i]
            k, v = (t.unsqueeze(0).to(self.device).contiguous() for t in kv)
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        if self.kinds.sliding:
            for i, kv in self._kv_of(self.kinds.sliding, window).items():
                layer = cache.layers[i]
                k, v = (t.unsqueeze(0).to(self.device).contiguous() for t in kv)
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
                layer.cumulative_length = tokens
        if state is not None:
            raw = torch.from_numpy(np.array(state, copy=True))
            offset = 0
            for i in self.kinds.linear:
                conv_shape, conv_dtype, rec_shape, rec_dtype = self.kinds.states[i]
                tensors = []
                for shape, dtype in ((conv_shape, conv_dtype), (rec_shape, rec_dtype)):
                    n = shape.numel() * dtype.itemsize
                    tensors.append(
                        raw[offset : offset + n].view(dtype).reshape(shape).to(self.device)
                    )
                    offset += n
                layer = cache.layers[i]
                layer.lazy_initialization(
                    conv_states=tensors[0],
                    recurrent_states=tensors[1],
                    conv_kernel_size=conv_shape[-1],
                )
                layer.conv_states[0].copy_(tensors[0])
                layer.recurrent_states[0].copy_(tensors[1])
                layer.has_previous_state[0] = True
                if hasattr(layer, "cumulative_length_linear"):
                    # transformers 5.25+: a linear layer counts its tokens, and the cache's
                    # length (the positions of the tokens after it) may be read off it
                    layer.cumulative_length_linear.fill_(tokens)
        return cache

    # -- a turn ----------------------------------------------------------------------------

    def prefill(self, tokens: Sequence[int]) -> HybridPrefill:
        """Resume ``tokens`` at the longest held checkpoint (one token at least is computed)
        and run the rest, capturing the checkpoints it passes."""
        ids = [int(t) for t in tokens]
        if not ids:
            raise InvalidInput("an empty prompt")
        bs = self.block_tokens
        t0 = time.perf_counter()
        usable = (len(ids) - 1) // bs
        end = self._resume_point(ids, usable)
        t1 = time.perf_counter()
        cache, end = self._load(ids, end)
        t2 = time.perf_counter()
        for i in self.kinds.sliding:  # keep whole windows until the captures are done
            cache.layers[i].activate_past_recording()
        checkpoints: list[Checkpoint] = []
        logits = []
        done = end * bs
        prompt_blocks, repeat_blocks = len(ids) // bs, (len(ids) - 1) // bs
        marks = [
            c
            for c in range(end + 1, prompt_blocks + 1)
            if is_checkpoint(
                c, prompt_blocks=prompt_blocks, repeat_blocks=repeat_blocks, stride=self.stride
            )
        ]
        for stop in [*(c * bs for c in marks), len(ids)]:
            if stop <= done:
                continue
            piece = torch.tensor([ids[done:stop]], dtype=torch.long)
            out, cache = model_forward(self.model, piece.to(self.device), cache)
            logits.append(out)
            done = stop
            if stop % bs == 0 and stop // bs in marks:
                checkpoints += self._capture(cache, stop // bs)
        for i in self.kinds.sliding:
            layer = cache.layers[i]
            layer.crop(0)
            layer.record_past = False
        t3 = time.perf_counter()
        cached = end * bs
        return HybridPrefill(
            torch.cat(logits, dim=1),
            cache,
            cached,
            len(ids) - cached,
            checkpoints,
            {"lookup": t1 - t0, "load": t2 - t1, "compute": t3 - t2},
        )

    def _resume_point(self, ids: list[int], usable: int) -> int:
        if usable <= 0:
            return 0
        return self.ops.held(self.namespace, ids[: usable * self.block_tokens], self.scope, 0)

    def _load(self, ids: list[int], end: int) -> tuple[Any, int]:
        """The cache resumed at ``end`` blocks (a fresh one, and 0, when the load failed)."""
        if end <= 0:
            return DynamicCache(config=self.model.config), 0
        spine = HostBlocks(self.spine_bytes)
        companions = [HostBlocks(n) for n in self.companion_bytes]
        wanted = [[(p, p) for p in spec.needed(0, end)] for spec in self.hybrid.companions]
        load = HybridLoad("prefill", ids, 0, end, list(range(end)), wanted, self.scope)
        got = self.ops.load(self.namespace, load, spine, companions)
        if got.blocks < end:
            return DynamicCache(config=self.model.config), 0
        window: list[BlockBytes] = []
        state = None
        for spec, rows in zip(self.hybrid.companions, companions, strict=True):
            if spec.kind == "window":
                window = [rows.rows[p] for p in spec.needed(0, end)]
            else:
                state = rows.rows[end - 1]
        return self._cache([spine.rows[p] for p in range(end)], window, state), end

    def _capture(self, cache: Any, end: int) -> list[Checkpoint]:
        out = []
        for c, spec in enumerate(self.hybrid.companions):
            positions = list(spec.stored_at(end))
            if spec.kind == "window":
                payloads = [self._block(cache, self.kinds.sliding, p) for p in positions]
            else:
                payloads = [self._state(cache)]
            out.append(Checkpoint(end, c, positions, payloads))
        return out

    def save(self, tokens: Sequence[int], prefill: HybridPrefill) -> int:
        """Store the spine's full blocks of ``tokens`` that ``prefill.cache`` holds and the
        node lacks, then the checkpoints the prefill captured; objects the node holds."""
        ids = [int(t) for t in tokens]
        cache = prefill.cache
        held_tokens = min(cache.layers[i].keys.shape[2] for i in self.kinds.full)
        full = min(len(ids), held_tokens) // self.block_tokens
        spine_ns, _ = self.hybrid.namespaces(self.namespace)
        kv = self.node.kv(self.scope)
        root = kv.root(spine_ns)
        conn = kv.connection
        chain = conn.block_hashes(root, ids[: full * self.block_tokens])
        held = (
            conn.lookup(root, chain[: conn.limits.max_ids], counted=False).matched if chain else 0
        )
        stored = 0
        if full > held:
            rows = HostBlocks(self.spine_bytes)
            rows.rows = {p: self._block(cache, self.kinds.full, p) for p in range(held, full)}
            transfer = Transfer(
                "save", ids[: full * self.block_tokens], held, list(range(held, full)), self.scope
            )
            stored = self.node.save(spine_ns, transfer, rows)
        return stored + self.ops.save_checkpoints(
            self.namespace, ids, self.scope, prefill.checkpoints
        )
