"""Hybrid models' KV against a real node (``connector.hybrid``, docs/hybrid.md): what each
kind of group needs to resume, the longest resumable prefix, checkpoints stored as companion
objects hung off the spine's chain and loaded back on both data paths, a lookup that never
stops where a companion's object is gone, tail-first eviction that keeps chain and objects
consistent, and two tenants: one cannot hang objects off the other's chain."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from sessioncache.clock import ManualClock
from sessioncache.connector.hybrid import (
    Checkpoint,
    GroupedLayout,
    GroupSpec,
    HybridLoad,
    HybridModel,
    HybridNode,
    is_checkpoint,
    resume_point,
)
from sessioncache.connector.paged import EngineNode, NodeSettings, PagedLayout, Scope, Transfer
from sessioncache.errors import InvalidInput, StoreRefused
from sessioncache.hashing import BlockHash, Namespace, block_hashes, keyed_block_ids
from sessioncache.store import TieredStore
from sessioncache.tiers.cpu import CpuTier
from tests.support.servers import Server, start_server

KEYS = {"key-a": "ta", "key-b": "tb"}
BLOCK_TOKENS = 4
NUM_BLOCKS = 64
WINDOW = GroupSpec("window", ("l0", "l1"), window_blocks=2)
STATE = GroupSpec("state", ("l2",))
FULL = GroupSpec("full", ("l3",))
MODEL = HybridModel(FULL, (WINDOW, STATE))


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("hybrid") / "data",
        {
            "SESSIONCACHE_API_KEYS": json.dumps(KEYS),
            "SESSIONCACHE_SHM_TRUSTED_TENANTS": json.dumps(sorted(KEYS.values())),
            # room for a chunk of each block size (spine, window, state): a tier of one
            # chunk gives it to the first size, and the others evict to get room
            "SESSIONCACHE_CPU_BYTES": str(512 << 20),
        },
    )
    yield server
    server.stop()


# -- what a resume needs ---------------------------------------------------------------------


def test_each_kind_needs_its_own_positions():
    assert list(FULL.needed(3, 8)) == [3, 4, 5, 6, 7]
    assert list(WINDOW.needed(3, 8)) == [6, 7]
    assert list(WINDOW.needed(7, 8)) == [7]  # the engine holds the rest of the window
    assert list(STATE.needed(3, 8)) == [7]
    assert list(STATE.needed(8, 8)) == []
    assert WINDOW.group == "window-2/l0,l1" and STATE.group == "state/l2"
    long = GroupSpec("full", tuple(f"model.layers.{i}.self_attn" for i in range(40)))
    assert len(long.group) <= 256 and long.group.startswith("full/40:")
    with pytest.raises(InvalidInput):
        GroupSpec("window", ("l0",))
    with pytest.raises(InvalidInput):
        GroupSpec("mamba", ("l0",))  # type: ignore[arg-type]


def test_resume_point_is_the_longest_prefix_every_group_can_resume():
    held = [True] * 10
    state = [False] * 10
    state[3] = state[7] = True  # checkpoints at 4 and 8 blocks
    assert resume_point(0, 10, [(STATE, state)]) == 8
    assert resume_point(0, 7, [(STATE, state)]) == 4  # the spine stops before the later one
    window = [True] * 10
    window[6] = False  # the window of the checkpoint at 8 lost a block
    assert resume_point(0, 10, [(STATE, state), (WINDOW, window)]) == 4
    assert resume_point(0, 10, [(WINDOW, held)]) == 10
    assert resume_point(0, 3, [(STATE, state)]) == 0
    # past a local prefix of 5 blocks, positions are counted from it
    assert resume_point(5, 10, [(STATE, state[5:])]) == 8


def test_checkpoints_fall_on_the_stride_and_the_turn_boundaries():
    marks = [
        n for n in range(1, 40) if is_checkpoint(n, prompt_blocks=21, repeat_blocks=20, stride=16)
    ]
    assert marks == [16, 20, 21, 32]
    assert not is_checkpoint(0, prompt_blocks=0, repeat_blocks=0, stride=16)


# -- against a node --------------------------------------------------------------------------


class Engine:
    """A toy paged cache: one tensor per layer, ``[NUM_BLOCKS, bytes]``."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.caches = {
            name: torch.randint(0, 256, (NUM_BLOCKS, size), generator=gen, dtype=torch.uint8)
            for name, size in (("l0", 96), ("l1", 96), ("l2", 160), ("l3", 128))
        }
        self.spine = PagedLayout({"l3": self.caches["l3"]}, NUM_BLOCKS, copy_threads=1)
        self.window = GroupedLayout(
            [PagedLayout({n: self.caches[n]}, NUM_BLOCKS, copy_threads=1) for n in ("l0", "l1")]
        )
        self.state = GroupedLayout(
            [PagedLayout({"l2": self.caches["l2"]}, NUM_BLOCKS, copy_threads=1)]
        )

    def close(self) -> None:
        for layout in (self.spine, self.window, self.state):
            layout.close()


def base_namespace(model: str) -> Namespace:
    return Namespace(model, BLOCK_TOKENS, "uint8", "toy-hybrid")


def tokens_of(seed: int, blocks: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 30_000, blocks * BLOCK_TOKENS)]


def save_turn(
    hn: HybridNode, ns: Namespace, engine: Engine, tokens: list[int], ends: list[int], scope: Scope
) -> int:
    """Engine A's save of a turn: the spine's blocks (engine block ``i`` at position ``i``),
    then the checkpoints' objects, captured from the same engine blocks."""
    spine_ns, _ = MODEL.namespaces(ns)
    full = len(tokens) // BLOCK_TOKENS
    hn.node.save(spine_ns, Transfer("a", tokens, 0, list(range(full)), scope), engine.spine)
    checkpoints = []
    for end in ends:
        for c, (spec, layout) in enumerate(((WINDOW, engine.window), (STATE, engine.state))):
            positions = list(spec.stored_at(end))
            targets = [(p,) * len(layout.layouts) for p in positions]
            checkpoints.append(Checkpoint(end, c, positions, layout.capture(targets)))
    return hn.save_checkpoints(ns, tokens, scope, checkpoints)


@pytest.mark.parametrize("path", ["same_host", "stream"])
def test_checkpoints_round_trip_into_another_engine(node: Server, path: str):
    ns = base_namespace(f"round-{path}")
    tokens = tokens_of(1, 12)
    a, b = Engine(1), Engine(2)
    settings = NodeSettings(node.url, api_key="key-a", data_path=path)
    writer, reader = EngineNode(settings), EngineNode(settings)
    try:
        stored = save_turn(HybridNode(writer, MODEL), ns, a, tokens, [4, 8], Scope())
        assert stored == 2 * (2 + 1)  # two checkpoints: a 2-block window and a state each
        hn = HybridNode(reader, MODEL)
        assert hn.held(ns, tokens, Scope(), 0) == 8  # not 12: no checkpoint past 8
        assert hn.held(ns, tokens[: 7 * BLOCK_TOKENS], Scope(), 0) == 4
        assert hn.held(ns, tokens, Scope(), 8) == 8  # the engine holds as much itself
        # B's blocks for the prefix of 8 lie elsewhere in its cache
        spine_targets = [40 + p for p in range(8)]
        window = [(p, (50 + p, 60 - p)) for p in WINDOW.needed(0, 8)]
        state = [(p, (20,)) for p in STATE.needed(0, 8)]
        load = HybridLoad("b", tokens[: 8 * BLOCK_TOKENS], 0, 8, spine_targets, [window, state])
        got = hn.load(ns, load, b.spine, [b.window, b.state])
        assert got.blocks == 8
        for p in range(8):
            assert torch.equal(b.caches["l3"][40 + p], a.caches["l3"][p])
        for p, (t0, t1) in window:
            assert torch.equal(b.caches["l0"][t0], a.caches["l0"][p])
            assert torch.equal(b.caches["l1"][t1], a.caches["l1"][p])
        assert torch.equal(b.caches["l2"][20], a.caches["l2"][7])
    finally:
        writer.close()
        reader.close()
        a.close()
        b.close()


def test_a_load_is_all_or_nothing(node: Server):
    ns = base_namespace("all-or-nothing")
    tokens = tokens_of(2, 8)
    a, b = Engine(3), Engine(4)
    settings = NodeSettings(node.url, api_key="key-a", data_path="stream")
    writer, reader = EngineNode(settings), EngineNode(settings)
    try:
        save_turn(HybridNode(writer, MODEL), ns, a, tokens, [4], Scope())
        hn = HybridNode(reader, MODEL)
        before = b.caches["l3"].clone()
        # asked to resume at 8 (a checkpoint the node does not hold): nothing is loaded
        load = HybridLoad(
            "b",
            tokens,
            0,
            8,
            list(range(8)),
            [[(p, (p, p)) for p in WINDOW.needed(0, 8)], [(7, (7,))]],
        )
        assert hn.load(ns, load, b.spine, [b.window, b.state]).blocks == 0
        assert torch.equal(b.caches["l3"], before)
    finally:
        writer.close()
        reader.close()
        a.close()
        b.close()


def test_checkpoints_past_the_stored_tokens_are_skipped(node: Server):
    """A checkpoint captured past the tokens a save covers (a step in flight when the request
    ended) is skipped, not an error: the node stays up for the other saves."""
    ns = base_namespace("past-the-end")
    tokens = tokens_of(5, 8)
    a = Engine(7)
    engine = EngineNode(NodeSettings(node.url, api_key="key-a", data_path="stream"))
    try:
        hn = HybridNode(engine, MODEL)
        spine_ns, _ = MODEL.namespaces(ns)
        engine.save(spine_ns, Transfer("a", tokens, 0, list(range(8)), Scope()), a.spine)
        late = Checkpoint(10, 1, [9], a.state.capture([(9,)]))
        on_time = Checkpoint(8, 1, [7], a.state.capture([(7,)]))
        assert hn.save_checkpoints(ns, tokens, Scope(), [on_time, late]) == 1
        assert hn.held(ns, tokens, Scope(), 0) == 0  # no window stored: no resume at 8
    finally:
        engine.close()
        a.close()


def test_another_tenant_cannot_hang_objects_off_a_chain(node: Server):
    """Tenant B knows A's spine ids (say it guessed them): its objects are refused, and B's
    own lookups of the same tokens see nothing of A's."""
    ns = base_namespace("tenants")
    tokens = tokens_of(3, 8)
    a = Engine(5)
    owner = EngineNode(NodeSettings(node.url, api_key="key-a", data_path="stream"))
    other = EngineNode(NodeSettings(node.url, api_key="key-b", data_path="stream"))
    try:
        save_turn(HybridNode(owner, MODEL), ns, a, tokens, [4], Scope())
        spine_ns, (window_ns, _) = MODEL.namespaces(ns)
        a_kv = owner.kv(Scope())
        a_ids = a_kv.connection.block_hashes(a_kv.root(spine_ns), tokens)
        b_kv = other.kv(Scope())
        b_root = b_kv.root(window_ns)
        payload = np.zeros(a.window.nbytes, np.uint8)
        with pytest.raises(StoreRefused):
            b_kv.connection.store_keyed(b_root, [a_ids[3]], [payload], parent=a_ids[3])
        assert HybridNode(other, MODEL).held(ns, tokens, Scope(), 0) == 0
        # nor may an unrelated namespace of A's own (another model) hang off its chain
        unrelated = Namespace("another-model", BLOCK_TOKENS, "uint8", "toy", group="state/x")
        root = a_kv.root(unrelated)
        with pytest.raises(StoreRefused):
            a_kv.connection.store_keyed(root, [a_ids[3]], [payload], parent=a_ids[3])
        # nor a chain segment (only keyed objects may hang off a related group)
        with pytest.raises(StoreRefused):
            a_kv.connection.store(a_kv.root(window_ns), tokens[16:20], [payload], parent=a_ids[3])
    finally:
        owner.close()
        other.close()
        a.close()


def test_a_session_pins_its_latest_checkpoint(node: Server):
    ns = base_namespace("session-pins")
    tokens = tokens_of(4, 8)
    a = Engine(6)
    engine = EngineNode(NodeSettings(node.url, api_key="key-a", data_path="stream"))
    try:
        kv = engine.kv(Scope())
        kv.client.open_session("hybrid-session")
        scope = Scope(session_id="hybrid-session")
        save_turn(HybridNode(engine, MODEL), ns, a, tokens, [8], scope)
        session = kv.client.get_session("hybrid-session")
        spine_ns, (_, state_ns) = MODEL.namespaces(ns)
        spine = kv.connection.block_hashes(kv.root(spine_ns), tokens)
        (state_id,) = kv.connection.key_ids(kv.root(state_ns), [spine[7]])
        # pinned: the chain to the spine's block 8, then the state object hung off it
        assert session.pinned and session.head == state_id
    finally:
        engine.close()
        a.close()


# -- eviction --------------------------------------------------------------------------------


def test_tail_first_eviction_keeps_chain_and_objects_consistent():
    """A spine chain under one root, a state object under another hung off each of its
    blocks, then filler: at every eviction, every object still held has its spine block, and
    every spine block held has its parent; the objects leave before their blocks."""
    clock = ManualClock()
    spine_root = Namespace("m", 4, "uint8", "l", group="full/l3").root()
    state_root = Namespace("m", 4, "uint8", "l", group="state/l2").root()
    store = TieredStore([CpuTier(20 * 64)], clock=clock)
    spine = block_hashes(Namespace("m", 4, "uint8", "l", group="full/l3"), list(range(32)))
    store.writes.put(spine, [b"s" * 64] * 8, namespace_root=spine_root)
    states = keyed_block_ids(state_root, spine)
    for block, obj in zip(spine, states, strict=True):
        clock.advance(1)
        store.writes.put([obj], [b"x" * 64], namespace_root=state_root, parent=block)
    parents: dict[BlockHash, BlockHash | None] = {
        **dict(zip(states, spine, strict=True)),
        **{h: (spine[i - 1] if i else None) for i, h in enumerate(spine)},
    }
    gone: list[BlockHash] = []
    filler = block_hashes(Namespace("f", 4, "uint8", "l"), list(range(200, 200 + 4 * 20)))
    for f in filler:
        clock.advance(1)
        store.writes.put([f], [b"f" * 64], namespace_root=b"\x01" * 16, parent=None)
        held = {h for h in parents if store.reads.where(h)}
        gone += [h for h in parents if h not in held and h not in gone]
        for h in held:
            parent = parents[h]
            assert parent is None or parent in held, "a block held without its parent"
    assert set(gone) == set(parents)
    for obj, block in zip(states, spine, strict=True):
        assert gone.index(obj) < gone.index(block)  # the object left first
