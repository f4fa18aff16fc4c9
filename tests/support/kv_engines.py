"""A simulated vLLM engine for the routing tests: it caches prompts block by block with
hashes of its own (random 64-bit ints, as a per-process-seeded engine has), emits the KV
events vLLM would (``tests/support/vllm_events.py``), and keeps a plain reference of what it
holds, by token prefix, against which ``/v1/route`` answers are checked."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tests.support import vllm_events as ve

WEIGHTS = {"GPU": 1.0, "CPU": 0.5, "STORAGE": 0.25}


@dataclass
class SimEngine:
    block_size: int
    legacy: bool
    publisher: ve.Publisher | None = None
    seed: int = 0
    prefixes: dict[int, tuple[tuple[int, ...], str | None]] = field(default_factory=dict)
    """Engine hash -> (the block's whole token prefix, LoRA): what the hash stands for."""
    media: dict[int, set[str]] = field(default_factory=dict)
    """Engine hash -> the media holding it now."""
    payloads: list[bytes] = field(default_factory=list)
    """Encoded batches, when there is no publisher."""

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._by_prefix: dict[tuple[tuple[int, ...], str | None, str | None], int] = {}

    # -- what the engine does ----------------------------------------------------------

    def cache(
        self,
        tokens: Sequence[int],
        *,
        lora: str | None = None,
        lora_id: int | None = None,
        medium: str = "GPU",
        send: bool = True,
        cache_salt: str | None = None,
    ) -> list[int]:
        """Cache the full blocks of ``tokens``; emit one BlockStored for the blocks new in
        ``medium`` (parent: the block before the first of them). Returns every block's
        hash. ``cache_salt``: the request's, in the hash of its first block (so in every
        hash of the chain) and in that block's extra keys, as vLLM does; the reference does
        not tell salts apart."""
        bs = self.block_size
        hashes: list[int] = []
        for i in range(len(tokens) // bs):
            key = (tuple(tokens[: (i + 1) * bs]), lora, cache_salt)
            h = self._by_prefix.get(key)
            if h is None:
                h = self._by_prefix[key] = self._rng.getrandbits(64)
                self.prefixes[h] = key[:2]
            hashes.append(h)
        # as vLLM: the blocks past the prefix already cached (in that medium) are new
        first = 0
        while first < len(hashes) and medium in self.media.get(hashes[first], set()):
            first += 1
        new = hashes[first:]
        for h in new:
            self.media.setdefault(h, set()).add(medium)
        if new:
            salted: list[tuple[Any, ...] | None] | None = None
            if cache_salt and not first:  # vLLM: the salt is one of the first block's keys
                salted = [(cache_salt,), *[None] * (len(new) - 1)]
            event = ve.stored(
                self.legacy,
                new,
                hashes[first - 1] if first else None,
                list(tokens[first * bs : len(hashes) * bs]),
                bs,
                medium=medium,
                lora_id=lora_id,
                lora_name=lora,
                extra_keys=salted,
            )
            self.emit([event], send=send)
        return hashes

    def remove(self, hashes: Sequence[int], medium: str = "GPU", *, send: bool = True) -> None:
        for h in hashes:
            self.media.get(h, set()).discard(medium)
        self.emit([ve.removed(self.legacy, list(hashes), medium)], send=send)

    def clear(self) -> None:
        for held in self.media.values():
            held.clear()
        self.emit([ve.cleared(self.legacy)])

    def emit(self, events: list[Any], *, send: bool = True) -> int:
        if self.publisher is not None:
            return self.publisher.publish(events, send=send)
        self.payloads.append(msgspec.msgpack.encode(ve.batch(self.legacy, events)))
        return len(self.payloads) - 1

    # -- the reference ---------------------------------------------------------------

    def reference(
        self,
        prompt: Sequence[int],
        lora: str | None = None,
        weights: Mapping[str, float] = WEIGHTS,
    ) -> dict[str, Any]:
        """The route answer for this engine, computed the plain way: walk the prompt's
        blocks while the engine holds that token prefix (under ``lora``) in any medium."""
        bs = self.block_size
        held: dict[tuple[tuple[int, ...], str | None], set[str]] = {}
        for h, key in self.prefixes.items():
            held.setdefault(key, set()).update(self.media.get(h, set()))
        matched = 0
        score = 0.0
        per_medium = dict.fromkeys(weights, 0)
        running = dict.fromkeys(weights, True)
        for i in range(len(prompt) // bs):
            media = held.get((tuple(prompt[: (i + 1) * bs]), lora), set())
            for m in per_medium:
                running[m] = running[m] and m in media
                per_medium[m] += bs if running[m] else 0
            if not media:
                break
            matched += 1
            score += bs * max(weights[m] for m in media)
        return {
            "matched_blocks": matched,
            "matched_tokens": matched * bs,
            "per_medium": per_medium,
            "score": score,
        }
