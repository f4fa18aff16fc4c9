"""Hybrid models (sliding-window, linear-attention or Mamba layers beside full attention)
against a node, whatever the engine (``connector.vllm`` is the first user; docs/hybrid.md).

A hybrid model's KV cache has groups of layers of one kind each. What a resumed prefix of
``n`` blocks needs from each kind (``GroupSpec.needed``):

- ``full``: every block before ``n``;
- ``window``: the ``window_blocks`` blocks before ``n`` (a sliding-window layer attends no
  further back);
- ``state``: the state at the end of block ``n - 1`` (a linear-attention or Mamba layer's
  whole past is one fixed-size state).

One group, the *spine* (the full-attention layers), is stored as a block chain, as a
full-attention model's KV is. Every other group is a *companion*: its objects are keyed blocks
of a namespace of its own (``Namespace.group``; a namespace holds one payload size), each
keyed by the spine's chain id at its position, stored only at *checkpoints* (a configurable
stride and turn boundaries), and hung off the spine block of that checkpoint, so that they
leave the store before it, tail first, and a session that stored them pins them with the
chain. Several engine groups of one kind and shape are one companion: their blocks side by
side (``GroupedLayout``).

The longest resumable prefix (``resume_point``) is the longest held spine prefix at which
every companion holds what it needs. The lookup asks the spine's chain (counted) and each
companion's ids (a probe); a load leases each part, and fails whole when any part is short.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import xxhash

from sessioncache.connector.paged import (
    BlockBytes,
    BlockCopier,
    EngineNode,
    Loaded,
    PagedLayout,
    Scope,
)
from sessioncache.errors import InvalidInput
from sessioncache.hashing import FIELD_LIMITS, Namespace

Kind = Literal["full", "window", "state"]
KINDS: tuple[Kind, ...] = ("full", "window", "state")
DEFAULT_CHECKPOINT_BLOCKS = 64
"""Blocks between two checkpoints of a prefix (besides the turn boundaries)."""


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One kind of a hybrid model's KV-cache groups: its kind, the layers it covers (in the
    namespace's group name), and for ``window`` the blocks a resume needs before its point."""

    kind: Kind
    layers: tuple[str, ...]
    window_blocks: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidInput(f"a group's kind is one of {KINDS}, got {self.kind!r}")
        if self.kind == "window" and self.window_blocks < 1:
            raise InvalidInput("a window group needs window_blocks >= 1")

    @property
    def group(self) -> str:
        """The ``Namespace.group`` of this kind's objects: kind, window and layers (a digest
        of the layers' names where they would not fit)."""
        kind = f"window-{self.window_blocks}" if self.kind == "window" else self.kind
        layers = ",".join(self.layers)
        name = f"{kind}/{layers}"
        if len(name) > FIELD_LIMITS["group"]:
            name = f"{kind}/{len(self.layers)}:{xxhash.xxh3_64_hexdigest(layers.encode())}"
        return name

    def needed(self, first: int, end: int) -> range:
        """Positions of this kind's objects a prefix of ``end`` blocks needs, past the
        ``first`` blocks the engine holds already (its own prefix cache)."""
        if end <= first:
            return range(0)
        if self.kind == "full":
            return range(first, end)
        if self.kind == "window":
            return range(max(first, end - self.window_blocks), end)
        return range(end - 1, end)

    def stored_at(self, checkpoint: int) -> range:
        """Positions of the objects a checkpoint at ``checkpoint`` blocks stores."""
        return self.needed(0, checkpoint)


def resume_point(
    first: int, spine: int, companions: Sequence[tuple[GroupSpec, Sequence[bool]]]
) -> int:
    """The longest prefix (in blocks, at most ``spine``, the held run of the spine's chain)
    at which every companion holds what it needs; ``held[i]``: whether the companion holds
    its object at position ``first + i``. ``first`` when there is none past it."""
    for end in range(spine, first, -1):
        if all(
            all(0 <= p - first < len(held) and held[p - first] for p in spec.needed(first, end))
            for spec, held in companions
        ):
            return end
    return first


def is_checkpoint(end: int, *, prompt_blocks: int, repeat_blocks: int, stride: int) -> bool:
    """Whether a prefix of ``end`` blocks is a checkpoint: a multiple of the stride, the end
    of the prompt (``prompt_blocks``, where the next turn resumes), or where this same prompt
    resumes when it is sent again (``repeat_blocks``: one token is always left to compute)."""
    if end <= 0:
        return False
    return end in (prompt_blocks, repeat_blocks) or (stride > 0 and end % stride == 0)


class GroupedLayout:
    """Several engine groups' blocks side by side as one sessioncache block (a companion):
    a target is one engine block id per group, in the layouts' order."""

    def __init__(self, layouts: Sequence[PagedLayout]) -> None:
        if not layouts:
            raise InvalidInput("a grouped layout needs at least one group")
        self.layouts = list(layouts)
        devices = {lay.device for lay in self.layouts}
        if len(devices) != 1:
            raise InvalidInput(f"groups on several devices: {sorted(map(str, devices))}")
        self.device = self.layouts[0].device
        self.offsets = list(np.cumsum([0, *(lay.nbytes for lay in self.layouts)]))
        self.nbytes = int(self.offsets[-1])

    def _split(self, buffers: Sequence[BlockBytes], g: int) -> list[BlockBytes]:
        lo, hi = int(self.offsets[g]), int(self.offsets[g + 1])
        for buf in buffers:
            if buf.nbytes != self.nbytes:
                raise InvalidInput(f"a block of {buf.nbytes} bytes for a layout of {self.nbytes}")
        return [buf[lo:hi] for buf in buffers]

    def scatter(self, targets: Sequence[Any], sources: Sequence[BlockBytes]) -> None:
        for g, layout in enumerate(self.layouts):
            layout.scatter([t[g] for t in targets], self._split(sources, g))

    def gather(self, targets: Sequence[Any], out: Sequence[BlockBytes]) -> None:
        for g, layout in enumerate(self.layouts):
            layout.gather([t[g] for t in targets], self._split(out, g))

    def capture(self, targets: Sequence[Any]) -> list[BlockBytes]:
        """Copies of the targets' blocks in host memory (the engine may reuse them next)."""
        out: list[BlockBytes] = [np.empty(self.nbytes, np.uint8) for _ in targets]
        self.gather(targets, out)
        return out

    def close(self) -> None:
        for layout in self.layouts:
            layout.close()


@dataclass(frozen=True, slots=True)
class HybridModel:
    """A hybrid model's groups as stored: the spine and its companions."""

    spine: GroupSpec
    companions: tuple[GroupSpec, ...]

    def namespaces(self, base: Namespace) -> tuple[Namespace, list[Namespace]]:
        """The spine's and each companion's namespace, derived from the model's."""
        return (
            replace(base, group=self.spine.group),
            [replace(base, group=c.group, kv_codec=_codec_of(base, c)) for c in self.companions],
        )


def _codec_of(base: Namespace, group: GroupSpec) -> str | None:
    """A companion's codec: the model's, except that a state (convolution and recurrent
    states, not KV vectors) is never quantized."""
    if group.kind == "state" and base.kv_codec is not None and base.kv_codec != "lossless":
        return None
    return base.kv_codec


@dataclass(slots=True)
class HybridLoad:
    """One request's load: blocks ``first .. end`` of the spine into ``spine_targets`` and,
    per companion, ``(position, target)`` for each engine block to fill."""

    req_id: str
    tokens: list[int]
    first: int
    end: int
    spine_targets: list[Any]
    companions: list[list[tuple[int, Any]]]
    scope: Scope = field(default_factory=Scope)


@dataclass(slots=True)
class Checkpoint:
    """A companion's objects of one checkpoint at ``end`` blocks (at ``positions``): their
    payloads, copied out of the engine."""

    end: int
    companion: int
    positions: list[int]
    payloads: list[Any] = field(default_factory=list)


class HybridNode:
    """A hybrid model's lookups, loads and saves over an ``EngineNode`` (module docstring)."""

    def __init__(self, node: EngineNode, model: HybridModel) -> None:
        self.node = node
        self.model = model

    def held(
        self,
        base: Namespace,
        tokens: Sequence[int],
        scope: Scope,
        first: int,
        *,
        declined: bool = False,
    ) -> int:
        """The longest resumable prefix of ``tokens``' full blocks (``resume_point``); the
        spine's lookup counts the prompt's hit and miss tokens. ``declined``: the engine
        loads nothing; the spine's lookup says so (``EngineNode.held_blocks``), and this is 0."""
        spine_ns, companion_ns = self.model.namespaces(base)
        kv = self.node.kv(scope)
        conn = kv.connection
        root = kv.root(spine_ns)
        ids = conn.block_hashes(root, tokens)
        spine = self.node.held_run(scope, root, ids, declined=declined)
        if spine <= first or not self.model.companions:
            return spine
        found = []
        for spec, ns in zip(self.model.companions, companion_ns, strict=True):
            croot = kv.root(ns)
            keys = conn.key_ids(croot, ids[first:spine])
            found.append((spec, conn.exists(croot, keys, counted=False)))
        return resume_point(first, spine, found)

    def load(
        self, base: Namespace, load: HybridLoad, spine: BlockCopier, companions: Sequence[Any]
    ) -> Loaded:
        """Every part of the load, each under its own lease: the companions' objects first,
        then the spine's blocks. All or nothing: the blocks loaded (``end - first``) or 0."""
        spine_ns, companion_ns = self.model.namespaces(base)
        kv = self.node.kv(load.scope)
        conn = kv.connection
        root = kv.root(spine_ns)
        ids = conn.block_hashes(root, load.tokens)[: load.end]
        if len(ids) < load.end:
            raise InvalidInput(f"{len(load.tokens)} tokens for a load of {load.end} blocks")
        copy_s = 0.0
        for wanted, ns, layout in zip(load.companions, companion_ns, companions, strict=True):
            if not wanted:
                continue
            croot = kv.root(ns)
            keys = conn.key_ids(croot, [ids[p] for p, _ in wanted])
            got = self.node.load_ids(
                load.scope, croot, keys, 0, [t for _, t in wanted], layout, keyed=True
            )
            copy_s += got.copy_s
            if got.blocks < len(wanted):
                return Loaded(0, copy_s)
        got = self.node.load_ids(load.scope, root, ids, load.first, load.spine_targets, spine)
        copy_s += got.copy_s
        if got.blocks < len(load.spine_targets):
            return Loaded(0, copy_s)
        return Loaded(load.end - load.first, copy_s)

    def save_checkpoints(
        self,
        base: Namespace,
        tokens: Sequence[int],
        scope: Scope,
        checkpoints: Sequence[Checkpoint],
    ) -> int:
        """Store each checkpoint's companion objects (stored after the spine:
        ``EngineNode.save``); how many objects the node holds. A checkpoint's companions form
        one chain hung off the spine's block at its end: the first companion's objects off
        that block, each next companion's off the last object before it. So they leave the
        store before that block, tail first, and the session (``scope``), recorded by the
        latest checkpoint's last store only, pins the chain to it and all of its objects. A
        checkpoint past ``tokens``' full blocks, or whose spine block the node lacks, is
        skipped."""
        spine_ns, companion_ns = self.model.namespaces(base)
        kv = self.node.kv(scope)
        conn = kv.connection
        root = kv.root(spine_ns)
        ids = conn.block_hashes(root, tokens)
        by_end: dict[int, list[Checkpoint]] = {}
        for checkpoint in checkpoints:
            if 0 < checkpoint.end <= len(ids) and checkpoint.payloads:
                by_end.setdefault(checkpoint.end, []).append(checkpoint)
        if not by_end:
            return 0
        ends = sorted(by_end)
        spine_held = conn.exists(root, [ids[e - 1] for e in ends], counted=False)
        held = 0
        for end, there in zip(ends, spine_held, strict=True):
            if not there:
                continue
            parent = ids[end - 1]
            group = sorted(by_end[end], key=lambda c: c.companion)
            for i, checkpoint in enumerate(group):
                last = end == ends[-1] and i == len(group) - 1
                keys = [ids[p] for p in checkpoint.positions]
                ack = conn.store_keyed(
                    kv.root(companion_ns[checkpoint.companion]),
                    keys,
                    checkpoint.payloads,
                    parent=parent,
                    linked=True,
                    session_id=scope.session_id if last else None,
                )
                held += sum(ack.held)
                if not all(ack.held):
                    break  # the rest of this checkpoint would hang off a missing object
                parent = ack.hashes[-1]
        return held
