"""The operation layer in-process, as every carrier calls it: sessions that go away mid-store,
raw session ids from the data plane, limits that belong to one carrier, EXISTS attribution,
and two tenants on one node."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sessioncache.config import Settings
from sessioncache.errors import InvalidInput, SessionNotFound
from sessioncache.hashing import BlockHash, Namespace, block_key, keyed_block_ids
from sessioncache.node import CacheNode
from sessioncache.operations import lookups, stores
from sessioncache.operations.caller import Caller
from sessioncache.operations.messages import LookupRequest, StoreRequest
from sessioncache.sessions.manager import SessionManager
from sessioncache.store import TieredStore
from sessioncache.tiers.cpu import CpuTier

NS = Namespace("ops", 4, "float16", "test")
SIZE = 32


@pytest.fixture
def node(tmp_path: Path) -> CacheNode:
    store = TieredStore([CpuTier(1 << 20)])
    settings = Settings(data_dir=tmp_path, api_keys={"ka": "alice", "kb": "bob"}, max_tokens=40)
    return CacheNode(settings, store, SessionManager(store))


def connection(node: CacheNode, tenant: str) -> tuple[Caller, bytes]:
    caller = Caller(tenant, keeps_leases=True)
    return caller, lookups.resolve(node, caller, NS)


def units(seed: int, blocks: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 1000, blocks * 4).astype("<u4").tobytes()


def store(node: CacheNode, caller: Caller, root: bytes, tokens: bytes, session: str | None):
    blocks = len(tokens) // 16
    request = StoreRequest(root, None, 4, blocks, SIZE, tokens, session_id=session)
    plan = stores.plan_store(node, caller, request)
    for i in range(blocks):
        stores.store_block(node, plan, i, b"x" * SIZE)
    return plan


def test_a_store_whose_session_closed_meanwhile_is_stored_all_the_same(node: CacheNode):
    caller, root = connection(node, "alice")
    session = node.sessions.open(tenant="alice")
    plan = store(node, caller, root, units(1, 3), session.id)
    node.sessions.close(session.id, tenant="alice")
    stores.complete(node, caller, plan, 3)  # no SessionNotFound after the blocks are held
    assert node.store.reads.contains_many(plan.ids) == [True] * 3


def test_a_store_that_kept_nothing_leaves_the_session_as_it_was(node: CacheNode):
    caller, root = connection(node, "alice")
    session = node.sessions.open(tenant="alice")
    plan = store(node, caller, root, units(2, 2), session.id)
    stores.complete(node, caller, plan, 0)
    got = node.sessions.get(session.id, tenant="alice")
    assert got.head is None and not got.pinned


@pytest.mark.parametrize("raw", ["a\x00b", "bad/id", "x" * 200, ""])
def test_raw_session_ids_are_refused_before_the_catalog_sees_them(node: CacheNode, raw: str):
    caller, root = connection(node, "alice")
    with pytest.raises(InvalidInput, match="session id"):
        lookups.lookup(node, caller, LookupRequest(root, [BlockHash(bytes(16))], session_id=raw))


def test_the_token_limit_of_rest_lookups_by_id_is_not_the_data_planes(node: CacheNode):
    caller, root = connection(node, "alice")
    ids = [BlockHash(bytes([i]) * 16) for i in range(11)]  # 44 tokens > max_tokens 40
    with pytest.raises(InvalidInput, match="exceed the limit of 40"):
        lookups.lookup_ids(node, caller, NS, ids)
    assert lookups.lookup(node, caller, LookupRequest(root, ids)).match.num_blocks == 0


def test_loads_naming_a_session_not_the_callers_do_nothing(node: CacheNode):
    alice, a_root = connection(node, "alice")
    bob, _ = connection(node, "bob")
    session = node.sessions.open(tenant="alice")
    plan = store(node, alice, a_root, units(3, 2), None)
    found = lookups.lookup(node, alice, LookupRequest(a_root, plan.ids, lease_s=10))
    assert found.key is not None
    for who in (bob, alice):
        sid = session.id if who is bob else "no-such-session"
        with pytest.raises(SessionNotFound):
            lookups.plan_load_ids(node, who, [BlockHash(bytes(16))], lease_s=5, session_id=sid)
        with pytest.raises(SessionNotFound):
            lookups.plan_load_lease(node, who, found.key, 0, 2, release=False, session_id=sid)
    assert node.sessions.get(session.id, tenant="alice").head is None
    assert len(alice.leases) == 1  # nothing taken by the refused loads


def test_a_load_by_ids_on_behalf_of_a_session_pins_what_it_sends(node: CacheNode):
    alice, root = connection(node, "alice")
    session = node.sessions.open(tenant="alice")
    plan = store(node, alice, root, units(4, 3), None)
    load = lookups.plan_load_ids(node, alice, plan.ids, lease_s=5, session_id=session.id)
    assert load.hashes == plan.ids
    got = node.sessions.get(session.id, tenant="alice")
    assert got.head == plan.ids[-1] and got.pinned
    lookups.finish_load(node, alice, load)


def test_exists_misses_are_attributed_so_the_reasons_add_up(node: CacheNode):
    alice, root = connection(node, "alice")
    keys = [block_key(f"k{i}") for i in range(4)]
    ids = keyed_block_ids(root, keys, node.settings.hash_seed)
    held = lookups.exists(node, alice, root, ids, counted=True)
    assert held == [False] * 4
    assert node.token_counts().miss == 16
    assert sum(node.attribution.miss_tokens().values()) == 16
    assert node.attribution.miss_tokens()["new"] == 16
    lookups.exists(node, alice, root, ids, counted=False)  # a probe: not counted
    assert node.token_counts().miss == 16
