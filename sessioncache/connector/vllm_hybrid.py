"""The vLLM connector's side of hybrid models (``connector.hybrid``, docs/hybrid.md): vLLM's
KV-cache groups read as a spine and companions, the scheduler's plan of each request's load,
checkpoint captures and save, and the worker's copies.

vLLM's hybrid memory allocator gives each KV-cache group a block table of its own over one
shared pool of blocks (block 0 is its null block, where a position holds nothing): a
full-attention group holds every position; a sliding-window group only the positions its
window still reaches (the rest are null); a Mamba group in ``mamba_cache_mode="align"`` holds,
at position ``i``, the state at the end of block ``i`` only while it is the state of a step's
end (a prefill chunk ends on a block boundary; decoding crosses one). So:

- the spine (full attention) is saved when the request finishes, from its blocks, which
  vLLM keeps until the save is done, as for a full-attention model;
- a companion's objects at a checkpoint are *captured* (copied to host memory) at the end of
  the step that computed them, before vLLM may free or reuse their blocks, and stored after
  the spine when the request finishes; a state's latest boundary is kept too, for the end of
  the output;
- a load fills, per group, the blocks vLLM allocated (not null) past its own prefix cache.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sessioncache.connector.hybrid import (
    Checkpoint,
    GroupedLayout,
    GroupSpec,
    HybridLoad,
    HybridModel,
    is_checkpoint,
)
from sessioncache.connector.paged import PagedLayout, Scope, Transfer

if TYPE_CHECKING:
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("vllm.sessioncache")

NULL_BLOCK = 0
"""vLLM's null block: a position a group holds nothing at."""


class Unsupported(Exception):
    """A KV-cache layout the connector cannot store (the reason)."""


@dataclass(frozen=True, slots=True)
class HybridGroups:
    """vLLM's KV-cache groups as stored: the model's spine and companions, and which vLLM
    groups (by index) each covers, side by side in that order."""

    model: HybridModel
    spine: tuple[int, ...]
    companions: tuple[tuple[int, ...], ...]
    layer_names: tuple[tuple[str, ...], ...]
    """Each vLLM group's layers."""


def hybrid_groups(kv_cache_config: KVCacheConfig, block_size: int) -> HybridGroups:
    """Read vLLM's groups: full-attention groups are the spine; sliding-window groups a
    window companion per window; Mamba groups (``align`` mode) a state companion. Groups of
    another kind, or of another block size, raise ``Unsupported``."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    kinds: dict[tuple[str, int], list[int]] = {}
    names: list[tuple[str, ...]] = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        names.append(tuple(group.layer_names))
        if spec.block_size != block_size:
            raise Unsupported(f"group {index} has blocks of {spec.block_size}, not {block_size}")
        if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            key = ("full", 0)
        elif isinstance(spec, SlidingWindowSpec):
            # a resume at n blocks needs the blocks holding tokens n*B - (window - 1) on
            # (vLLM frees the ones before them)
            window = -(-(spec.sliding_window - 1 + spec.extra_retained_tokens) // block_size)
            key = ("window", max(1, window))
        elif isinstance(spec, MambaSpec):
            if spec.num_speculative_blocks:
                raise Unsupported(
                    f"group {index}: Mamba states of speculative decoding move between blocks"
                )
            if spec.mamba_cache_mode != "align":
                raise Unsupported(
                    f"group {index}: Mamba states at block boundaries need "
                    f'mamba_cache_mode="align" (this engine runs {spec.mamba_cache_mode!r})'
                )
            key = ("state", 0)
        else:
            raise Unsupported(f"group {index}: {type(spec).__name__} is not stored")
        kinds.setdefault(key, []).append(index)
    spine = kinds.pop(("full", 0), None)
    if spine is None:
        raise Unsupported("no full-attention group to chain the others to")

    def spec_of(key: tuple[str, int], groups: list[int]) -> GroupSpec:
        layers = tuple(n for g in groups for n in names[g])
        return GroupSpec(key[0], layers, key[1])  # type: ignore[arg-type]

    keys = sorted(kinds)
    return HybridGroups(
        HybridModel(spec_of(("full", 0), spine), tuple(spec_of(k, kinds[k]) for k in keys)),
        tuple(spine),
        tuple(tuple(kinds[k]) for k in keys),
        tuple(names),
    )


@dataclass(slots=True)
class Capture:
    """Copy, at the end of this step, one companion's objects of a checkpoint (``keep``: to
    store when the request finishes) or a state that is the request's latest (``latest``)."""

    req_id: str
    checkpoint: Checkpoint
    targets: list[tuple[int, ...]]
    keep: bool = True
    latest: bool = False


@dataclass(slots=True)
class HybridSave:
    """A finished request's save of its ``end`` full blocks: the spine's blocks past those
    the node held, then the checkpoints captured, one at the end of the output from its
    blocks (``finish``: targets per checkpoint), and its latest state when it ends there."""

    req_id: str
    tokens: list[int]
    end: int
    spine: Transfer | None
    scope: Scope
    finish: list[tuple[Checkpoint, list[tuple[int, ...]]]] = field(default_factory=list)
    finish_reason: str | None = None
    """Why the request finished, sent to its session once the save is done
    (``finish_session``; the connector's ``finish_reason``)."""

    @property
    def holds_blocks(self) -> bool:
        """Whether it reads the request's blocks (vLLM keeps them until it is done)."""
        return self.spine is not None or bool(self.finish)


def _at(table: Sequence[Sequence[int]], groups: Sequence[int], position: int) -> tuple[int, ...]:
    """The position's block in each group (``NULL_BLOCK`` past a group's table)."""
    return tuple(table[g][position] if position < len(table[g]) else NULL_BLOCK for g in groups)


def _targets(
    table: Sequence[Sequence[int]], groups: Sequence[int], positions: Sequence[int]
) -> list[tuple[int, ...]] | None:
    """Each position's block in each group, or None when one is not held (null, or past the
    table)."""
    out = []
    for p in positions:
        target = _at(table, groups, p)
        if NULL_BLOCK in target:
            return None
        out.append(target)
    return out


class HybridPlanner:
    """The scheduler side: each request's block tables (as vLLM's scheduler output gives
    them), prompt length and computed tokens, and from them its loads, captures and save."""

    def __init__(self, groups: HybridGroups, block_size: int, stride: int) -> None:
        self.groups = groups
        self.block_size = block_size
        self.stride = stride
        self._tables: dict[str, list[list[int]]] = {}
        self._prompt: dict[str, int] = {}

    def load(
        self,
        req_id: str,
        tokens: list[int],
        blocks: KVCacheBlocks,
        first: int,
        end: int,
        scope: Scope,
    ) -> HybridLoad | None:
        """The load of blocks ``first .. end`` into what vLLM allocated; None when vLLM wants
        a block no stored object fills (the engine then recomputes)."""
        table = [[b.block_id if not b.is_null else NULL_BLOCK for b in g] for g in blocks.blocks]
        spine = _targets(table, self.groups.spine, range(first, end))
        if spine is None:
            return None
        wanted: list[list[tuple[int, Any]]] = []
        for spec, groups in zip(self.groups.model.companions, self.groups.companions, strict=True):
            needed = set(spec.needed(first, end))
            parts: list[tuple[int, Any]] = []
            for p in range(first, end):
                held = _at(table, groups, p)
                if all(b == NULL_BLOCK for b in held):
                    continue  # vLLM keeps nothing here for these layers
                if p not in needed or NULL_BLOCK in held:
                    log.warning(
                        "sessioncache: %s wants block %d of %s, which no checkpoint holds",
                        req_id,
                        p,
                        spec.group,
                    )
                    return None
                parts.append((p, held))
            wanted.append(parts)
        return HybridLoad(req_id, tokens[: end * self.block_size], first, end, spine, wanted, scope)

    def step(self, out: SchedulerOutput) -> list[Capture]:
        """Follow the step's block tables; the captures due at its end."""
        progress: list[tuple[str, int]] = []
        for new in out.scheduled_new_reqs:
            self._tables[new.req_id] = [list(ids) for ids in new.block_ids]
            self._prompt[new.req_id] = len(new.prompt_token_ids or [])
            progress.append((new.req_id, new.num_computed_tokens))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self._tables[req_id] = [list(ids) for ids in new_ids or ()]
            elif new_ids is not None and req_id in self._tables:
                for table, ids in zip(self._tables[req_id], new_ids, strict=True):
                    table.extend(ids)
            progress.append((req_id, cached.num_computed_tokens[i]))
        captures: list[Capture] = []
        for req_id, before in progress:
            # draft tokens of speculative decoding are not KV to keep: they may be rejected
            drafts = len(out.scheduled_spec_decode_tokens.get(req_id, ()))
            after = before + out.num_scheduled_tokens.get(req_id, 0) - drafts
            if req_id in self._tables:
                captures += self._due(req_id, before, after)
        return captures

    def _due(self, req_id: str, before: int, after: int) -> list[Capture]:
        bs = self.block_size
        table = self._tables[req_id]
        prompt = self._prompt.get(req_id, 0)
        out: list[Capture] = []
        model = self.groups.model
        for end in range(before // bs + 1, after // bs + 1):
            keep = is_checkpoint(
                end,
                prompt_blocks=prompt // bs,
                repeat_blocks=(prompt - 1) // bs,
                stride=self.stride,
            )
            at_boundary = end * bs == after  # a state is materialised at a step's end only
            for c, (spec, groups) in enumerate(
                zip(model.companions, self.groups.companions, strict=True)
            ):
                # every state a step ends on is kept as the latest (the output's end, maybe);
                # a window, at checkpoints only
                latest = spec.kind == "state"
                if not (at_boundary if latest else keep):
                    continue
                positions = list(spec.stored_at(end))
                targets = _targets(table, groups, positions)
                if targets is not None:
                    checkpoint = Checkpoint(end, c, positions)
                    out.append(Capture(req_id, checkpoint, targets, keep, latest))
        return out

    def finished(
        self,
        req_id: str,
        tokens: list[int],
        held: int,
        computed: int,
        block_ids: Sequence[Sequence[int]],
        scope: Scope,
    ) -> HybridSave:
        """The save of a finished request whose first ``computed`` tokens' KV is computed,
        ``held`` blocks of it were the node's (its tables forgotten)."""
        self._tables.pop(req_id, None)
        self._prompt.pop(req_id, None)
        bs = self.block_size
        full = min(computed, len(tokens)) // bs
        save = HybridSave(req_id, tokens[: full * bs], full, None, scope)
        spine = _targets(block_ids, self.groups.spine, range(held, full))
        if spine and full > held:
            save.spine = Transfer(req_id, save.tokens, held, list(spine), scope)  # type: ignore[arg-type]
        for c, (spec, groups) in enumerate(
            zip(self.groups.model.companions, self.groups.companions, strict=True)
        ):
            if spec.kind == "state":
                continue  # the worker keeps the latest state
            positions = list(spec.stored_at(full))
            targets = _targets(block_ids, groups, positions)
            if targets is not None and positions:
                save.finish.append((Checkpoint(full, c, positions), targets))
        return save


class HybridCopies:
    """The worker side: each group's paged layout, the spine's and each companion's
    ``GroupedLayout``, and the captured checkpoints and latest states of running requests,
    within ``capture_bytes`` in all."""

    def __init__(
        self,
        groups: HybridGroups,
        kv_caches: dict[str, torch.Tensor],
        num_blocks: int,
        copy_threads: int | None,
        capture_bytes: int,
    ) -> None:
        def layout(indices: Sequence[int]) -> GroupedLayout:
            return GroupedLayout(
                [
                    PagedLayout(
                        {n: kv_caches[n] for n in groups.layer_names[g]},
                        num_blocks,
                        copy_threads=copy_threads,
                    )
                    for g in indices
                ]
            )

        self.spine = layout(groups.spine)
        self.companions = [layout(c) for c in groups.companions]
        self.capture_bytes = capture_bytes
        self._kept: dict[str, list[Checkpoint]] = {}
        self._latest: dict[str, Checkpoint] = {}
        self._warned = False

    def capture(self, captures: Sequence[Capture]) -> None:
        """Copy the step's captures out of the cache (at its end, before vLLM may reuse the
        blocks), within ``capture_bytes``."""
        for cap in captures:
            layout = self.companions[cap.checkpoint.companion]
            size = layout.nbytes * len(cap.targets)
            held = self.held_bytes()
            if held + size > self.capture_bytes:
                if not self._warned:
                    log.warning(
                        "sessioncache: checkpoints of running requests hold %d bytes "
                        "(capture_bytes): later ones are not stored",
                        held,
                    )
                    self._warned = True
                continue
            checkpoint = Checkpoint(
                cap.checkpoint.end,
                cap.checkpoint.companion,
                cap.checkpoint.positions,
                layout.capture(cap.targets),
            )
            if cap.latest:
                self._latest[cap.req_id] = checkpoint
            if cap.keep:
                self._kept.setdefault(cap.req_id, []).append(checkpoint)

    def held_bytes(self) -> int:
        """Bytes of the checkpoints held for running requests (one held as kept and latest
        counts once)."""
        held = {id(c): c for kept in self._kept.values() for c in kept}
        held.update((id(c), c) for c in self._latest.values())
        return sum(int(p.nbytes) for c in held.values() for p in c.payloads)

    def checkpoints(self, save: HybridSave) -> list[Checkpoint]:
        """A finished request's checkpoints to store: those captured, the end of its output
        copied from its blocks now, and its latest state when it ends there (its captures
        released)."""
        kept = self._kept.pop(save.req_id, [])
        latest = self._latest.pop(save.req_id, None)
        seen = {(c.end, c.companion) for c in kept}
        out = list(kept)
        if (
            latest is not None
            and latest.end == save.end
            and (latest.end, latest.companion) not in seen
        ):
            out.append(latest)
        for checkpoint, targets in save.finish:
            if (checkpoint.end, checkpoint.companion) in seen:
                continue
            layout = self.companions[checkpoint.companion]
            out.append(
                Checkpoint(
                    checkpoint.end,
                    checkpoint.companion,
                    checkpoint.positions,
                    layout.capture(targets),
                )
            )
        return sorted(out, key=lambda c: (c.end, c.companion))

    def close(self) -> None:
        self.spine.close()
        for layout in self.companions:
            layout.close()
