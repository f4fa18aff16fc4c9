"""A REST store plan (``POST /v1/store``) and its session, in-process as the route calls it: the
session's chain moves when the plan's uploads are answered, never when the plan is made."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sessioncache.config import Settings
from sessioncache.hashing import Namespace
from sessioncache.node import CacheNode
from sessioncache.operations import sessions, stores
from sessioncache.operations.caller import Caller
from sessioncache.operations.messages import SessionOpen
from sessioncache.sessions.manager import SessionManager
from sessioncache.status import BlockStatus
from sessioncache.store import TieredStore
from sessioncache.tiers.cpu import CpuTier

NS = Namespace("plans", 4, "float16", "test")
SIZE = 32


@pytest.fixture
def node(tmp_path: Path) -> CacheNode:
    store = TieredStore([CpuTier(1 << 20)])
    settings = Settings(data_dir=tmp_path, api_keys={"ka": "alice"})
    return CacheNode(settings, store, SessionManager(store))


def prompt(seed: int, blocks: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 1000, blocks * 4).astype("<u4").tobytes()


def upload_all(node: CacheNode, caller: Caller, plan: stores.UploadPlan) -> None:
    for block_hash in plan.missing:
        assert stores.upload(node, caller, block_hash, b"x" * SIZE) is BlockStatus.STORED


def test_a_plan_whose_uploads_never_come_leaves_the_session_as_it_was(node: CacheNode):
    caller = Caller("alice")
    sid = sessions.open_session(node, caller, SessionOpen("s")).session.id
    first = stores.plan_upload(node, caller, NS, prompt(1, 3), session_id=sid)
    upload_all(node, caller, first)
    before = node.sessions.get(sid, tenant="alice")
    assert before.head == first.hashes[-1] and before.pinned

    # another prompt (it left the first one's chain): planned, never uploaded
    other = stores.plan_upload(
        node, caller, NS, prompt(2, 4), session_id=sid, finish_reason="tool_use"
    )
    assert other.missing == other.hashes
    now = node.sessions.get(sid, tenant="alice")
    assert now.head == before.head and now.pinned
    assert node.sessions.pinned_sessions() == [("alice", sid)]
    assert all(m.ref_cnt for m in map(node.store.reads.meta, first.hashes) if m is not None)

    # some uploads: still nothing moves
    for block_hash in other.missing[:3]:
        stores.upload(node, caller, block_hash, b"y" * SIZE)
    assert node.sessions.get(sid, tenant="alice").head == first.hashes[-1]

    # the last one: the chain is the new prompt's, pinned
    stores.upload(node, caller, other.missing[3], b"y" * SIZE)
    after = sessions.get_session(node, caller, sid)
    assert after.session.head == other.hashes[-1] and after.session.pinned
    held = [node.store.reads.meta(h) for h in other.hashes]
    assert all(m is not None and m.ref_cnt for m in held)


def test_a_plan_with_nothing_to_upload_records_at_once(node: CacheNode):
    caller = Caller("alice")
    sid = sessions.open_session(node, caller, SessionOpen("s2")).session.id
    tokens = prompt(3, 2)
    upload_all(node, caller, stores.plan_upload(node, caller, NS, tokens))  # no session
    assert node.sessions.get(sid, tenant="alice").head is None
    plan = stores.plan_upload(node, caller, NS, tokens, session_id=sid)
    assert not plan.missing
    assert node.sessions.get(sid, tenant="alice").head == plan.hashes[-1]


def test_a_dropped_upload_ends_the_recorded_chain_and_a_retry_joins_it(node: CacheNode):
    caller = Caller("alice")
    sid = sessions.open_session(node, caller, SessionOpen("s3")).session.id
    plan = stores.plan_upload(node, caller, NS, prompt(4, 3), session_id=sid)
    stores.upload(node, caller, plan.missing[0], b"z" * SIZE)
    # block 2 before block 1: dropped (a block never hangs off a parent the store lacks)
    assert stores.upload(node, caller, plan.missing[2], b"z" * SIZE) is BlockStatus.DROPPED
    assert node.sessions.get(sid, tenant="alice").head is None  # block 1 unanswered
    stores.upload(node, caller, plan.missing[1], b"z" * SIZE)
    # every block answered: the chain is the held prefix, blocks 0 and 1
    assert node.sessions.get(sid, tenant="alice").head == plan.hashes[1]
    # the retry of the dropped block is stored and pinned with the session's chain
    assert stores.upload(node, caller, plan.missing[2], b"z" * SIZE) is BlockStatus.STORED
    meta = node.store.reads.meta(plan.hashes[2])
    assert meta is not None and meta.ref_cnt
