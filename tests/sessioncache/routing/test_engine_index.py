"""The engine index against the plain reference of tests/support/kv_engines.py: random
stores, offloads, removals (in the middle of chains too) and clears, on engines of both
encodings and of different block sizes, more engines than one numpy word holds."""

from __future__ import annotations

import random
from dataclasses import replace

import msgspec
import pytest

from sessioncache.errors import EngineExists
from sessioncache.hashing import (
    Namespace,
    block_hashes,
    block_hashes_from_bytes,
    tokens_to_le_bytes,
)
from sessioncache.routing.engine_index import EngineIndex
from sessioncache.routing.events import decode_batch
from tests.support import vllm_events as ve
from tests.support.kv_engines import WEIGHTS, SimEngine

NS = Namespace("m", 16, "bf16", "x")


def ns_for(block_tokens: int, lora: str | None = None) -> Namespace:
    return replace(NS, block_tokens=block_tokens, lora=lora)


def add(index: EngineIndex, engine_id: str, block_tokens: int) -> None:
    index.add(engine_id, block_tokens, lambda lora, keys: ns_for(block_tokens, lora).root())


def drain(index: EngineIndex, engine_id: str, engine: SimEngine) -> None:
    for payload in engine.payloads:
        index.apply(engine_id, decode_batch(payload))
    engine.payloads.clear()


def check(
    index: EngineIndex, engines: dict[str, SimEngine], prompt: list[int], lora: str | None = None
) -> None:
    for block_tokens in {e.block_size for e in engines.values()}:
        names = [n for n, e in engines.items() if e.block_size == block_tokens]
        ids = block_hashes(ns_for(block_tokens, lora), prompt)
        got = index.match(ids, names, WEIGHTS)
        for name in names:
            want = engines[name].reference(prompt, lora)
            m = got[name]
            assert m.matched_blocks == want["matched_blocks"], name
            assert {k: v * block_tokens for k, v in m.per_medium.items()} == want["per_medium"]
            assert m.weighted_blocks * block_tokens == pytest.approx(want["score"])


def test_random_histories_match_the_reference():
    rng = random.Random(1)
    index = EngineIndex()
    engines: dict[str, SimEngine] = {}
    for i in range(25):  # 25 engines: two 63-bit words
        bs = (16, 32)[i % 2]
        engines[f"e{i}"] = SimEngine(bs, legacy=i % 3 == 0, seed=i)
        add(index, f"e{i}", bs)
    base = [rng.randrange(50_000) for _ in range(256)]
    prompts = [base[: rng.randrange(0, 257)] + [rng.randrange(50_000) for _ in range(64)]]
    for _ in range(6):
        prompts.append(prompts[-1][: rng.randrange(0, 300)] + [rng.randrange(9) for _ in range(96)])
    for _step in range(300):
        name = f"e{rng.randrange(25)}"
        e = engines[name]
        op = rng.random()
        if op < 0.55:
            medium = rng.choice(["GPU", "GPU", "CPU", "STORAGE"])
            e.cache(rng.choice(prompts), medium=medium)
        elif op < 0.9:
            held = [h for h, media in e.media.items() if media]
            if held:
                h = rng.choice(held)
                e.remove([h], rng.choice(sorted(e.media[h])))
        elif op < 0.93:
            e.clear()
        drain(index, name, e)
        if _step % 20 == 0:
            for prompt in prompts:
                check(index, engines, prompt)
    for prompt in prompts:
        check(index, engines, prompt)
    total = sum(sum(index.counts(n)[1].values()) for n in engines)
    assert total == sum(len(m) for e in engines.values() for m in e.media.values())


def test_removal_in_the_middle_stops_the_prefix_and_children_still_chain():
    index = EngineIndex()
    e = SimEngine(16, legacy=False)
    add(index, "a", 16)
    prompt = list(range(16 * 8))
    hashes = e.cache(prompt)
    e.remove([hashes[3]])
    drain(index, "a", e)
    ids = block_hashes(NS, prompt)
    assert index.match(ids, ["a"], WEIGHTS)["a"].matched_blocks == 3
    # the removed block comes back and a child of a removed parent is still indexed
    e.cache(prompt + list(range(500, 532)))
    drain(index, "a", e)
    ids = block_hashes(NS, prompt + list(range(500, 532)))
    assert index.match(ids, ["a"], WEIGHTS)["a"].matched_blocks == 10
    check(index, {"a": e}, prompt + list(range(500, 532)))


def test_lora_blocks_match_only_their_lora():
    index = EngineIndex()
    new, old = SimEngine(16, legacy=False), SimEngine(16, legacy=True)
    add(index, "new", 16)
    add(index, "old", 16)
    prompt = list(range(64))
    new.cache(prompt, lora="sql", lora_id=1)
    # vLLM before lora_name: only the int id, which then names the LoRA as "7"
    old.emit([ve.stored(True, [1, 2, 3, 4], None, prompt, 16, lora_id=7)])
    drain(index, "new", new)
    drain(index, "old", old)
    for lora, want in ((None, (0, 0)), ("sql", (4, 0)), ("7", (0, 4))):
        got = index.match(block_hashes(ns_for(16, lora), prompt), ["new", "old"], WEIGHTS)
        assert (got["new"].matched_blocks, got["old"].matched_blocks) == want, lora


def test_blocks_that_cannot_be_indexed_are_counted_and_skipped():
    index = EngineIndex()
    add(index, "a", 16)
    toks = list(range(32))
    for event in (
        ve.stored(False, [1, 2], 999, toks, 16),  # a parent never reported
        ve.stored(False, [1, 2], None, toks, 32),  # another block size
        ve.stored(False, [1, 2], None, toks[:20], 16),  # too few tokens
        ve.BlockStored([1, 2], None, toks, 16, None, "GPU", None, group_idx=1),
    ):
        index.apply("a", decode_batch(msgspec.msgpack.encode(ve.batch(False, [event]))))
    counts, held = index.counts("a")
    assert counts.skipped_blocks == 8 and counts.blocks_stored == 0
    assert held == {"GPU": 0, "CPU": 0, "STORAGE": 0}
    assert index.indexed_blocks() == 0
    with pytest.raises(EngineExists):
        add(index, "a", 16)


def test_same_tokens_under_two_engine_hashes_survive_one_removal():
    """vLLM's hash also covers extra keys (a cache salt, multimodal inputs): the same tokens
    may come under two hashes of one engine."""
    index = EngineIndex()
    add(index, "a", 16)
    toks = list(range(16))
    for h in (1, 2):
        ev = ve.stored(False, [h], None, toks, 16)
        index.apply("a", decode_batch(msgspec.msgpack.encode(ve.batch(False, [ev]))))
    ev = ve.removed(False, [1])
    index.apply("a", decode_batch(msgspec.msgpack.encode(ve.batch(False, [ev]))))
    assert index.match(block_hashes(NS, toks), ["a"], WEIGHTS)["a"].matched_blocks == 1
    ev = ve.removed(False, [2])
    index.apply("a", decode_batch(msgspec.msgpack.encode(ve.batch(False, [ev]))))
    assert index.match(block_hashes(NS, toks), ["a"], WEIGHTS)["a"].matched_blocks == 0
    assert index.indexed_blocks() == 0


def test_removing_an_engine_frees_its_slot_and_its_blocks():
    index = EngineIndex()
    e = SimEngine(16, legacy=False)
    add(index, "a", 16)
    add(index, "b", 16)
    e.cache(list(range(64)))
    drain(index, "a", e)
    assert index.indexed_blocks() == 4
    index.remove("a")
    assert index.indexed_blocks() == 0
    add(index, "c", 16)  # takes a's slot: nothing of a's shows through
    ids = block_hashes(NS, list(range(64)))
    assert index.match(ids, ["b", "c"], WEIGHTS)["c"].matched_blocks == 0


def test_a_chain_is_rooted_by_the_keys_of_its_first_block():
    """``RootFor`` sees the first block's extra keys: here, a cache salt picks one of two
    roots, and a chain with none is not indexed, nor what the engine chains onto it."""
    index = EngineIndex()
    roots = {salt: ns_for(16, None).root(seed) for seed, salt in enumerate(("s1", "s2"), 1)}
    index.add("a", 16, lambda lora, keys: next((roots[k] for k in keys if k in roots), None))
    e = SimEngine(16, legacy=False)
    p, q = list(range(64)), list(range(100, 164))
    e.cache(p[:32], cache_salt="s1")
    e.cache(p, cache_salt="s1")  # chained onto s1's chain: no keys of its own
    e.cache(q, cache_salt="s2")
    e.cache(q)
    e.cache(q + list(range(16)))  # onto the chain without a salt
    drain(index, "a", e)
    for salt, prompt, want in (("s1", p, 4), ("s2", q, 4), ("s1", q, 0), ("s2", p, 0)):
        ids = block_hashes_from_bytes(roots[salt], tokens_to_le_bytes(prompt), 16)
        assert index.match(ids, ["a"], WEIGHTS)["a"].matched_blocks == want, (salt, want)
    assert index.counts("a")[0].skipped_blocks == 5
