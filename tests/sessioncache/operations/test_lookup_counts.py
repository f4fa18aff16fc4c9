"""The store's lookup counters as every data-plane carrier drives them: a counted LOOKUP,
LOCATE or EXISTS is one lookup; an uncounted lookup, a load by ids and a store's plan are
none."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sessioncache.config import Settings
from sessioncache.hashing import Namespace, block_key, keyed_block_ids
from sessioncache.node import CacheNode
from sessioncache.operations import lookups, stores
from sessioncache.operations.caller import Caller
from sessioncache.operations.messages import LookupRequest, StoreRequest
from sessioncache.sessions.manager import SessionManager
from sessioncache.store import TieredStore
from sessioncache.store.results import Counters
from sessioncache.tiers.cpu import CpuTier

NS = Namespace("counts", 4, "float16", "test")
SIZE = 32


@pytest.fixture
def node(tmp_path: Path) -> CacheNode:
    store = TieredStore([CpuTier(1 << 20)])
    return CacheNode(Settings(data_dir=tmp_path), store, SessionManager(store))


def counts(node: CacheNode) -> tuple[int, int, int]:
    c: Counters = node.store.counters()
    return c.lookups, c.hit_blocks, c.miss_blocks


def test_only_counted_questions_count(node: CacheNode):
    caller = Caller("default", keeps_leases=True)
    root = lookups.resolve(node, caller, NS)
    tokens = np.arange(3 * 4, dtype="<u4").tobytes()
    plan = stores.plan_store(node, caller, StoreRequest(root, None, 4, 3, SIZE, tokens))
    for i in range(3):
        stores.store_block(node, plan, i, b"x" * SIZE)
    stores.complete(node, caller, plan, 3)
    ids = plan.ids
    assert counts(node) == (0, 0, 0)

    session = node.sessions.open()
    probe = LookupRequest(root, ids, lease_s=5, counted=False, session_id=session.id)
    found = lookups.lookup(node, caller, probe)
    assert found.match.num_blocks == 3 and found.key is not None
    lookups.release(node, caller, found.key)
    load = lookups.plan_load_ids(node, caller, ids, lease_s=5)
    lookups.finish_load(node, caller, load)
    each = lookups.plan_load_ids(node, caller, ids, lease_s=5, each=True)
    lookups.finish_load(node, caller, each)
    assert lookups.exists(node, caller, root, ids, counted=False) == [True] * 3
    assert counts(node) == (0, 0, 0)

    found = lookups.lookup(node, caller, LookupRequest(root, [*ids, block_key("x")]))
    assert found.match.num_blocks == 3
    assert counts(node) == (1, 3, 0)  # past the held chain: not asked of the store
    keys = keyed_block_ids(root, [block_key("a"), block_key("b")], node.settings.hash_seed)
    assert lookups.exists(node, caller, root, [ids[0], *keys], counted=True) == [
        True,
        False,
        False,
    ]
    assert counts(node) == (2, 4, 2)
    assert node.token_counts().hit == 4 * 4 and node.token_counts().miss == 3 * 4
