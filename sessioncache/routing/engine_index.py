"""What every engine holds, by sessioncache block id, from its KV cache events (no I/O).

One dict maps each sessioncache id any engine holds to a bit mask: three bits per engine slot
(GPU, CPU, STORAGE), 21 slots per 63 bits. A route reads one mask per prompt block, whatever
the number of engines, and then compares every engine at once with numpy. Per engine, a dict
maps the engine's own block hash to the sessioncache id, only to apply its ``BlockRemoved``
and to chain a later ``BlockStored`` onto its ``parent_block_hash``; a bounded dict keeps the
ids of recently removed blocks, whose children may still arrive.

Ids are recomputed from the events' ``token_ids`` with ``hashing.block_hashes_from_bytes``,
from the root the engine's ``RootFor`` gives a chain (its namespace, with the event's LoRA,
salted with the tenant routed to it): equal prefixes give the ids a router's prompt gives,
whatever the engine's hash function or seed.
"""

from __future__ import annotations

import functools
import sys
import threading
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Any

import numpy as np
import numpy.typing as npt

from sessioncache.errors import EngineExists, InvalidInput
from sessioncache.hashing import block_hashes_from_bytes, tokens_to_le_bytes
from sessioncache.routing.events import (
    CPU,
    GPU,
    MEDIA,
    STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    EventBatch,
)

BITS_PER_ENGINE = 3
SLOTS_PER_WORD = 21
"""21 engines of 3 bits fill 63 bits: one uint64 word of numpy per 21 engines."""
MEDIUM_BIT = {GPU: 1, CPU: 2, STORAGE: 4}
GHOSTS = 1 << 16
"""Removed blocks whose id is kept per engine, for children stored after their parent left
(vLLM evicts free blocks in LRU order, not only tails)."""

RootFor = Callable[[str | None, Sequence[object]], bytes | None]
"""The root of a chain the engine starts, from the chain's LoRA name (None: the base model)
and the extra keys of its first block as the engine reported them (vLLM's: the LoRA,
multimodal ids, the request's ``cache_salt``; empty when none). None: the chain is not
indexed (``skipped_blocks``), nor are the blocks the engine chains onto it."""


def medium_bit(medium: str) -> int:
    """Media other than vLLM's three (a connector's own names) count as storage."""
    return MEDIUM_BIT.get(medium, MEDIUM_BIT[STORAGE])


def _bit_offset(slot: int) -> int:
    return 63 * (slot // SLOTS_PER_WORD) + BITS_PER_ENGINE * (slot % SLOTS_PER_WORD)


@dataclass(slots=True)
class EngineCounts:
    """What one engine's events did, for ``GET /v1/engines``."""

    batches: int = 0
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    cleared: int = 0
    skipped_blocks: int = 0
    """Blocks of a BlockStored that could not be indexed: another block size, a parent never
    reported or not indexed, a chain without a root (``RootFor``), another KV cache group,
    too few token ids."""
    unknown_events: int = 0


@dataclass(slots=True)
class _View:
    slot: int
    block_tokens: int
    root_for: RootFor
    seed: int
    shift: int
    hashes: dict[EngineHash, bytes] = field(default_factory=dict)
    ghosts: dict[EngineHash, bytes] = field(default_factory=dict)
    dups: dict[bytes, int] = field(default_factory=dict)
    """Ids the engine reported under more than one of its hashes (the same tokens with other
    extra keys, e.g. multimodal inputs or a cache salt): how many more."""
    held: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MEDIA, 0))
    counts: EngineCounts = field(default_factory=EngineCounts)


@dataclass(frozen=True, slots=True)
class EngineMatch:
    """One engine's cached prefix of a prompt."""

    matched_blocks: int
    per_medium: dict[str, int]
    """Per medium, how many leading blocks the engine holds in that medium."""
    weighted_blocks: float
    """Sum over the matched blocks of the weight of the best medium holding each."""


class EngineIndex:
    """Thread-safe: the subscriber thread applies batches while routes read."""

    def __init__(self) -> None:
        self._ids: dict[bytes, int] = {}
        self._views: dict[str, _View] = {}
        self._lock = threading.Lock()

    # -- engines -----------------------------------------------------------------------

    def add(self, engine_id: str, block_tokens: int, root_for: RootFor, seed: int = 0) -> None:
        """Index ``engine_id``'s events from now on, each chain from the root ``root_for``
        gives it; ``EngineExists`` if the id is indexed already."""
        with self._lock:
            if engine_id in self._views:
                raise EngineExists(f"engine {engine_id!r} is already registered")
            used = {v.slot for v in self._views.values()}
            slot = next(s for s in range(len(used) + 1) if s not in used)
            self._views[engine_id] = _View(slot, block_tokens, root_for, seed, _bit_offset(slot))

    def remove(self, engine_id: str) -> None:
        with self._lock:
            view = self._views.pop(engine_id, None)
            if view is not None:
                self._drop_all(view)

    def clear(self, engine_id: str) -> None:
        """Forget what the engine holds (its events can no longer be trusted to follow on)."""
        with self._lock:
            view = self._views.get(engine_id)
            if view is not None:
                self._drop_all(view)

    def engines(self) -> list[str]:
        with self._lock:
            return list(self._views)

    def counts(self, engine_id: str) -> tuple[EngineCounts, dict[str, int]]:
        """A copy of the engine's counters and of how many blocks it holds per medium."""
        with self._lock:
            view = self._views[engine_id]
            return replace(view.counts), dict(view.held)

    def indexed_blocks(self) -> int:
        """Distinct ids held by at least one engine."""
        with self._lock:
            return len(self._ids)

    def _drop_all(self, view: _View) -> None:
        ids = self._ids
        clear = ~(7 << view.shift)
        for x in set(view.hashes.values()):
            m = ids.get(x, 0) & clear
            if m:
                ids[x] = m
            else:
                ids.pop(x, None)
        view.hashes.clear()
        view.ghosts.clear()
        view.dups.clear()
        view.held = dict.fromkeys(MEDIA, 0)

    # -- events ------------------------------------------------------------------------

    def apply(self, engine_id: str, batch: EventBatch) -> None:
        """Apply one decoded batch, in order; an engine no longer indexed is ignored."""
        with self._lock:
            view = self._views.get(engine_id)
            if view is None:
                return
            counts = view.counts
            counts.batches += 1
            counts.events += len(batch.events)
            counts.unknown_events += batch.unknown
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self._stored(view, event)
                elif isinstance(event, BlockRemoved):
                    self._removed(view, event)
                elif isinstance(event, AllBlocksCleared):
                    counts.cleared += 1
                    self._drop_all(view)

    def _stored(self, view: _View, ev: BlockStored) -> None:
        n = len(ev.block_hashes)
        bs = view.block_tokens
        # Only the first KV cache group (full attention) of a hybrid model: the others repeat
        # the same hashes for their own layers.
        if ev.group_idx not in (None, 0) or ev.block_size != bs or len(ev.token_ids) < n * bs:
            view.counts.skipped_blocks += n
            return
        if ev.parent_block_hash is None:
            lora = ev.lora_name if ev.lora_name is not None else _lora(ev.lora_id)
            root = view.root_for(lora, _first_keys(ev.extra_keys))
            if root is None:
                view.counts.skipped_blocks += n
                return
            parent = root
        else:
            found = view.hashes.get(ev.parent_block_hash)
            if found is None:
                found = view.ghosts.get(ev.parent_block_hash)
            if found is None:  # joined after the parent was reported, or a view dropped
                view.counts.skipped_blocks += n
                return
            parent = found
        token_bytes = _token_bytes(ev.token_ids[: n * bs])
        if token_bytes is None:
            view.counts.skipped_blocks += n
            return
        new_ids = block_hashes_from_bytes(parent, token_bytes, bs, view.seed)
        bit = medium_bit(ev.medium) << view.shift
        ids, hashes, dups = self._ids, view.hashes, view.dups
        view.counts.blocks_stored += n
        # The usual batch: blocks no engine has reported, under hashes new to this engine;
        # the dicts are then updated at C speed.
        if not any(map(hashes.__contains__, ev.block_hashes)) and not any(
            map(ids.__contains__, new_ids)
        ):
            hashes.update(zip(ev.block_hashes, new_ids, strict=True))
            ids.update(zip(new_ids, repeat(bit)))
            view.held[_medium_name(ev.medium)] += len(set(new_ids))
            return
        added = 0
        for h, x in zip(ev.block_hashes, new_ids, strict=True):
            prev = hashes.get(h)
            if prev is None:
                hashes[h] = x
                if (ids.get(x, 0) >> view.shift) & 7:
                    dups[x] = dups.get(x, 0) + 1
            elif prev != x:  # the engine reused a hash for other tokens: the old block left
                self._forget(view, h, prev, 7 << view.shift)
                hashes[h] = x
            m = ids.get(x, 0)
            if not m & bit:
                ids[x] = m | bit
                added += 1
        view.held[_medium_name(ev.medium)] += added

    def _removed(self, view: _View, ev: BlockRemoved) -> None:
        if ev.group_idx not in (None, 0):
            return
        bit = medium_bit(ev.medium) << view.shift
        hashes = view.hashes
        for h in ev.block_hashes:
            x = hashes.get(h)
            if x is None:
                continue
            view.counts.blocks_removed += 1
            self._forget(view, h, x, bit)

    def _forget(self, view: _View, h: EngineHash, x: bytes, bits: int) -> None:
        """Clear ``bits`` (of this engine) for ``x``, reported under the engine's hash ``h``."""
        ids = self._ids
        extra = view.dups.get(x, 0)
        if extra:  # another of the engine's hashes still names x: keep its bits
            if extra == 1:
                del view.dups[x]
            else:
                view.dups[x] = extra - 1
            self._to_ghost(view, h, x)
            return
        m = ids.get(x, 0)
        gone = m & bits
        for medium in MEDIA:
            if gone & (MEDIUM_BIT[medium] << view.shift):
                view.held[medium] -= 1
        m &= ~bits
        if m:
            ids[x] = m
        else:
            ids.pop(x, None)
        if not (m >> view.shift) & 7:
            self._to_ghost(view, h, x)

    @staticmethod
    def _to_ghost(view: _View, h: EngineHash, x: bytes) -> None:
        view.hashes.pop(h, None)
        ghosts = view.ghosts
        ghosts[h] = x
        if len(ghosts) > GHOSTS:
            del ghosts[next(iter(ghosts))]

    # -- routes ------------------------------------------------------------------------

    def match(
        self,
        ids: Sequence[bytes],
        engines: Iterable[str],
        weights: Mapping[str, float],
    ) -> dict[str, EngineMatch]:
        """Each named engine's cached prefix of the chain ``ids`` (engines not indexed are
        left out). ``weights``: per medium, the worth of one block held there."""
        with self._lock:
            views = {e: self._views[e] for e in engines if e in self._views}
            masks = list(map(self._ids.get, ids, repeat(0, len(ids))))
        if 0 in masks:  # past the first block no engine holds, no engine's prefix goes on
            masks = masks[: masks.index(0)]
        out: dict[str, EngineMatch] = {}
        if not views:
            return out
        table = _weight_table(tuple(sorted(weights.items())))
        by_word: dict[int, list[tuple[str, int]]] = {}
        for engine, view in views.items():
            by_word.setdefault(view.slot // SLOTS_PER_WORD, []).append(
                (engine, BITS_PER_ENGINE * (view.slot % SLOTS_PER_WORD))
            )
        for word, members in by_word.items():
            arr = _word(masks, word)  # n + 1 entries: a last 0 ends every engine's run
            shifts = np.array([s for _, s in members], dtype=np.uint64)
            # (engines, blocks + 1): each engine's media per block, one contiguous row each
            sub = ((arr[None, :] >> shifts[:, None]) & np.uint64(7)).astype(np.uint8)
            matched = np.argmin(sub, axis=1)  # the first 0 of each row
            present = np.bitwise_or.reduce(sub, axis=1)
            for j, (engine, _) in enumerate(members):
                m = int(matched[j])
                kinds = int(present[j])
                if m == 0:
                    out[engine] = EngineMatch(0, dict.fromkeys(MEDIA, 0), 0.0)
                elif kinds in _SINGLE:  # one medium only (the usual case): no per-block work
                    medium = _SINGLE[kinds]
                    per = dict.fromkeys(MEDIA, 0)
                    per[medium] = m
                    out[engine] = EngineMatch(m, per, m * float(table[kinds]))
                else:
                    row = sub[j, : m + 1]  # ends with a 0: argmin finds each medium's end
                    out[engine] = EngineMatch(
                        m,
                        {md: int(np.argmin(row & b)) for md, b in MEDIUM_BIT.items()},
                        float(table[row[:m]].sum()),
                    )
        return out


_NATIVE_LE = sys.byteorder == "little" and array("I").itemsize == 4


def _token_bytes(tokens: list[int]) -> bytes | None:
    """Token ids as little-endian uint32 (None when one is not in [0, 2**32)): ``array``
    converts a list of ints at C speed, several times faster than numpy's ``asarray``."""
    if _NATIVE_LE:
        try:
            return array("I", tokens).tobytes()
        except (OverflowError, TypeError):
            return None
    try:
        return tokens_to_le_bytes(tokens)
    except InvalidInput:
        return None


def _lora(lora_id: int | None) -> str | None:
    """Engines before vLLM's ``lora_name`` report only the LoRA's int id: its decimal form
    names the LoRA then (docs/routing.md)."""
    return None if lora_id is None else str(lora_id)


def _first_keys(extra_keys: list[Any] | None) -> Sequence[object]:
    """The extra keys of a chain's first block (vLLM sends a list, or None, per block)."""
    first = extra_keys[0] if extra_keys else None
    return first if isinstance(first, list) else ()


def _medium_name(medium: str) -> str:
    return medium if medium in MEDIUM_BIT else STORAGE


_SINGLE = {b: m for m, b in MEDIUM_BIT.items()}


@functools.lru_cache(maxsize=16)
def _weight_table(weights: tuple[tuple[str, float], ...]) -> npt.NDArray[np.float64]:
    """Mask (0..7) -> the weight of its best medium."""
    by_name = dict(weights)
    table = np.zeros(8)
    for mask in range(1, 8):
        table[mask] = max(by_name.get(m, 0.0) for m, b in MEDIUM_BIT.items() if mask & b)
    table.flags.writeable = False
    return table


def _word(masks: list[int], word: int) -> npt.NDArray[np.uint64]:
    """The ``word``-th 63 bits of every mask as uint64, and a 0 after the last."""
    low = (1 << 63) - 1
    out = np.zeros(len(masks) + 1, dtype=np.uint64)
    try:
        if word == 0:  # masks of at most 21 engines fit; more overflow (then the slow way)
            out[:-1] = masks
            return out
    except OverflowError:
        pass
    shift = 63 * word
    out[:-1] = [(m >> shift) & low for m in masks]
    return out
