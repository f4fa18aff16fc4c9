"""``CacheNode.lookup_ids`` in-process: which ids may match (``chain_prefix``), holes in the
held run, and which lookups the API may run on its event loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sessioncache.config import Settings
from sessioncache.errors import InvalidInput
from sessioncache.hashing import BlockHash, Namespace
from sessioncache.node import CacheNode
from sessioncache.operations import lookups, stores
from sessioncache.operations.caller import Caller
from sessioncache.sessions.manager import SessionManager
from sessioncache.store import TieredStore
from sessioncache.tiers.cpu import CpuTier

NS = Namespace("node-ids", 4, "float16", "test")
OTHER = Namespace("node-ids-other", 4, "float16", "test")


@pytest.fixture
def node(tmp_path: Path) -> CacheNode:
    store = TieredStore([CpuTier(1 << 20)])
    settings = Settings(data_dir=tmp_path, api_keys={"ka": "acme", "kg": "globex"})
    return CacheNode(settings, store, SessionManager(store))


def store_prompt(node: CacheNode, tenant: str, ns: Namespace, seed: int, blocks: int):
    token_bytes = np.random.default_rng(seed).integers(0, 1000, blocks * 4).astype("<u4").tobytes()
    plan = stores.plan_upload(node, Caller(tenant), ns, token_bytes)
    for h in plan.missing:
        assert stores.upload(node, Caller(tenant), h, b"p" * 32)
    return plan.hashes


def matched(node: CacheNode, ids: list[BlockHash], tenant: str = "acme", ns: Namespace = NS):
    return lookups.lookup_ids(node, Caller(tenant), ns, ids).match.num_blocks


def test_the_callers_chain_matches_and_nothing_else(node: CacheNode):
    ids = store_prompt(node, "acme", NS, 1, 8)
    theirs = store_prompt(node, "globex", NS, 1, 8)  # same tokens, the other tenant's root
    assert theirs != ids
    assert matched(node, ids) == 8
    assert matched(node, ids[:5]) == 5 and matched(node, []) == 0
    assert matched(node, theirs) == 0 and matched(node, ids, "globex") == 0
    assert matched(node, ids, ns=OTHER) == 0
    assert matched(node, [*ids[:3], *theirs[3:]]) == 3
    assert matched(node, [*ids[:3], ids[4], ids[3], *ids[5:]]) == 3
    assert matched(node, ids[2:]) == 0
    assert lookups.chain_prefix(node, node.namespace_root("acme", NS), [*ids, *ids]) == 8


def test_a_foreign_id_is_not_touched_leased_or_counted(node: CacheNode):
    ids = store_prompt(node, "acme", NS, 2, 4)
    theirs = store_prompt(node, "globex", NS, 2, 4)
    before = node.store.reads.meta(theirs[2])
    assert before is not None
    hits = node.store.counters().hit_blocks
    result = lookups.lookup_ids(node, Caller("acme"), NS, [*ids[:2], *theirs[2:]], lease_s=10)
    assert result.match.num_blocks == 2 and result.match.lease is not None
    assert result.match.lease.hashes == tuple(ids[:2])
    assert node.store.counters().hit_blocks == hits + 2
    after = node.store.reads.meta(theirs[2])
    assert after is not None and after.hit_count == before.hit_count
    assert after.ref_cnt == 0 and after.last_access == before.last_access


def test_a_hole_in_the_held_run(node: CacheNode):
    ids = store_prompt(node, "acme", NS, 3, 8)
    assert node.store.writes.delete([ids[7], ids[6], ids[5]]) == 3  # the tail first (children held)
    assert matched(node, ids) == 5
    # a block dropped from the middle while its child stays held: the match ends before it
    assert node.store.writes.delete([ids[2]]) == 1
    assert node.store.reads.contains(ids[3]) and not node.store.reads.contains(ids[2])
    assert matched(node, ids) == 2
    assert matched(node, ids[:2]) == 2


def test_id_lookups_obey_max_tokens(tmp_path: Path):
    store = TieredStore([CpuTier(1 << 20)])
    node = CacheNode(Settings(data_dir=tmp_path, max_tokens=40), store, SessionManager(store))
    assert (
        lookups.lookup_ids(
            node, Caller("default"), NS, [BlockHash(bytes(16))] * 10
        ).match.num_blocks
        == 0
    )
    with pytest.raises(InvalidInput, match="11 blocks of 4 tokens exceed the limit of 40"):
        lookups.lookup_ids(node, Caller("default"), NS, [BlockHash(bytes(16))] * 11)


def test_which_lookups_wait_on_io(node: CacheNode):
    assert node.lookup_waits_on_io("acme", NS, session_id=None)  # root not recorded yet
    node.namespace_root("acme", NS)
    assert not node.lookup_waits_on_io("acme", NS, session_id=None)
    assert node.lookup_waits_on_io("acme", NS, session_id="s")
    assert node.lookup_waits_on_io("globex", NS, session_id=None)


def test_a_deep_foreign_chain_is_never_walked(node: CacheNode, monkeypatch: pytest.MonkeyPatch):
    """chain_to walks a block's whole held ancestry under the store lock: a short request
    naming a deep block of someone else's chain must not make the node walk it."""
    ids = store_prompt(node, "acme", NS, 4, 2)
    theirs = store_prompt(node, "globex", NS, 5, 64)
    walks: list[bytes] = []
    real = node.store.reads.chain_to

    def spy(head: BlockHash) -> list[BlockHash]:
        walks.append(head)
        return real(head)

    monkeypatch.setattr(node.store.reads, "chain_to", spy)
    assert matched(node, [ids[0], theirs[63]]) == 1
    assert matched(node, [ids[0], *theirs[62:]]) == 1
    assert walks == []
    assert matched(node, ids) == 2 and walks == [ids[1]]
