"""Prefetch (``sessions.prefetch``, ``store.prefetch``): a session's chain moved up from disk
into the CPU tier on request and ahead of its forecast return; a grant admitted against the
tenant's share, evicting only what returns later and never a pinned block of anyone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from sessioncache.clock import ManualClock
from sessioncache.config import Settings
from sessioncache.errors import SessionNotFound
from sessioncache.factory import open_node
from sessioncache.hashing import BlockHash, Namespace, block_hashes
from sessioncache.node import OPEN_TENANT
from sessioncache.quotas import PinBudget
from sessioncache.replay.runner import run_replay
from sessioncache.replay.trace import Request, Trace
from sessioncache.sessions.manager import SessionManager
from sessioncache.sessions.prefetch import ACCEPTED, DEFERRED, REJECTED, Prefetcher
from sessioncache.store import TieredStore
from sessioncache.store.eviction import EvictionPolicy
from sessioncache.store.forecast import Forecast
from sessioncache.tiers.cpu import CpuTier
from sessioncache.tiers.disk import DiskTier

SIZE = 64
NAMESPACES = {t: Namespace(f"model-{t}", 4, "u8", "x") for t in ("alice", "bob", "carol")}
ROOTS = {NAMESPACES[t].root(): t for t in NAMESPACES}


def chain(tenant: str, seed: int, blocks: int) -> list[BlockHash]:
    tokens = [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, blocks * 4)]
    return block_hashes(NAMESPACES[tenant], tokens)


class Node:
    """A store of a CPU tier over a disk tier, sessions and the prefetch engine, unstarted:
    ``drain`` runs the moves."""

    def __init__(
        self,
        path: Path,
        cpu_blocks: int,
        *,
        share: float = 1.0,
        forecast: bool = True,
        pin_share: float = 1.0,
    ) -> None:
        self.clock = ManualClock()
        self.store = TieredStore(
            [CpuTier(cpu_blocks * SIZE), DiskTier.open(path, 1000 * SIZE)],
            EvictionPolicy(2, Forecast()),  # dates: the ``next_use`` mode's (a setting)
            clock=self.clock,
            default_ttl_s=1e6,
        )
        self.share = share
        self.sessions = SessionManager(self.store, pin_share=pin_share, budget=self.budget)
        self.prefetch = Prefetcher(
            self.store,
            self.sessions,
            budget=self.budget,
            tenant_of=lambda root: ROOTS.get(root, ""),
            forecast=forecast,
        )

    def budget(self, tenant: str) -> PinBudget:
        return PinBudget(tenant, self.share, [NAMESPACES[tenant].root()])

    def session(self, tenant: str, sid: str, hashes: list[BlockHash], finish: str) -> None:
        """A turn of ``sid``: its chain stored, then finished for ``finish``."""
        self.sessions.open(sid, tenant=tenant)
        payloads = [(h * 4)[:SIZE] for h in hashes]
        self.store.writes.put(hashes, payloads, namespace_root=NAMESPACES[tenant].root())
        self.sessions.record(sid, hashes, tenant=tenant, finish_reason=finish)

    def fastest(self, hashes: list[BlockHash]) -> list[str]:
        return [(self.store.reads.where(h) or ["-"])[0] for h in hashes]

    def idle(self, seconds: float) -> None:
        """Time passes; the sweep unpins idle sessions."""
        self.clock.advance(seconds)
        self.sessions.sweep()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    made = Node(tmp_path, 8)
    yield made
    made.store.close()


def test_a_prefetch_moves_a_demoted_chain_up_and_resident_counts_it(node: Node) -> None:
    mine = chain("alice", 1, 6)
    node.session("alice", "s", mine, "stop")
    node.idle(600)
    other = chain("alice", 2, 8)
    node.session("alice", "t", other, "tool_use")  # pushes "s" down to disk
    assert node.prefetch.resident(("alice", "s")) == {"cpu": 0, "disk": 6}
    node.idle(600)  # "t" unpinned too
    outcome = node.prefetch.request(("alice", "s"))
    assert (outcome.outcome, outcome.blocks) == (ACCEPTED, 6)
    node.prefetch.drain()
    assert node.prefetch.resident(("alice", "s")) == {"cpu": 6, "disk": 0}
    assert node.fastest(mine) == ["cpu"] * 6
    # the read that follows is served from memory
    assert node.sessions.lookup("s", mine, tenant="alice").tiers == ["cpu"] * 6


def test_an_unknown_session_is_not_found(node: Node) -> None:
    with pytest.raises(SessionNotFound):
        node.prefetch.request(("alice", "nope"))
    with pytest.raises(SessionNotFound):
        node.prefetch.resident(("alice", "nope"))
    node.session("alice", "s", chain("alice", 1, 2), "stop")
    with pytest.raises(SessionNotFound):  # another tenant's session of that id
        node.prefetch.request(("bob", "s"))


def test_bobs_prefetch_flood_leaves_alices_pinned_and_sooner_blocks_in_the_cpu_tier(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, 8, share=0.5)
    try:
        bobs = [chain("bob", 10 + i, 4) for i in range(4)]
        for i, hashes in enumerate(bobs):
            node.session("bob", f"b{i}", hashes, "stop")
        node.idle(7200)  # bob's sessions are long overdue: forecast back last
        sooner = chain("alice", 1, 2)
        node.session("alice", "sooner", sooner, "stop")
        node.idle(600)  # unpinned, back within the hour by its forecast
        pinned = chain("alice", 2, 2)
        node.session("alice", "pinned", pinned, "tool_use")  # live: pinned
        assert node.fastest(sooner + pinned) == ["cpu"] * 4
        outcomes = [node.prefetch.request(("bob", f"b{i}")) for i in range(4) for _ in range(3)]
        node.prefetch.drain()
        assert node.fastest(sooner + pinned) == ["cpu"] * 4
        assert {o.outcome for o in outcomes} <= {ACCEPTED, DEFERRED, REJECTED}
        refused = [o for o in outcomes if o.outcome != ACCEPTED]
        assert refused and all(o.reason for o in refused)
        # bob's grants stay within his share of the CPU tier (4 of 8 blocks)
        assert node.store.reads.pinned_under([NAMESPACES["bob"].root()])[0] <= 4 * SIZE
    finally:
        node.store.close()


def test_alices_prefetch_is_refused_only_by_her_own_share(tmp_path: Path) -> None:
    node = Node(tmp_path, 16, share=0.5)  # 8 blocks of the CPU tier per tenant
    try:
        bobs = [chain("bob", 10 + i, 4) for i in range(4)]
        for i, hashes in enumerate(bobs):
            node.session("bob", f"b{i}", hashes, "stop")
        alices = [chain("alice", i, n) for i, n in enumerate((6, 4, 4))]
        for i, hashes in enumerate(alices):
            node.session("alice", f"a{i}", hashes, "stop")
        node.idle(310)
        node.session("carol", "c", chain("carol", 1, 16), "stop")  # back after all of them
        node.idle(310)
        assert all(node.fastest(h) == ["disk"] * len(h) for h in bobs + alices)
        flood = [node.prefetch.request(("bob", f"b{i}")) for i in range(4) for _ in range(2)]
        granted = [o for o in flood if o.outcome == ACCEPTED and o.reason != "queued already"]
        assert sum(o.blocks for o in granted) == 8  # his share
        assert {o.outcome for o in flood} == {ACCEPTED, REJECTED}
        assert all("'bob'" in o.reason for o in flood if o.outcome == REJECTED)
        node.prefetch.drain()
        first, cut, refused = (node.prefetch.request(("alice", f"a{i}")) for i in range(3))
        assert (first.outcome, first.blocks) == (ACCEPTED, 6)
        assert (cut.outcome, cut.blocks) == (ACCEPTED, 2) and "pin_share" in cut.reason
        assert refused.outcome == REJECTED and "'alice'" in refused.reason
        node.prefetch.drain()
        assert node.fastest(alices[0] + alices[1][:2]) == ["cpu"] * 8
        assert node.prefetch.resident(("alice", "a1")) == {"cpu": 2, "disk": 2}
    finally:
        node.store.close()


def test_the_forecast_promotes_a_chain_ahead_of_its_return(node: Node) -> None:
    soon = chain("alice", 1, 4)
    node.session("alice", "soon", soon, "stop")
    node.idle(310)  # unpinned
    later = chain("alice", 2, 8)
    node.session("alice", "later", later, "stop")  # stored while running: "soon" went down
    assert node.fastest(soon) == ["disk"] * 4
    node.idle(310)  # both unpinned; "soon" is forecast back before "later"
    assert node.prefetch.tick() == 1
    node.prefetch.drain()
    assert node.fastest(soon) == ["cpu"] * 4
    assert node.prefetch.tick() == 0  # up already: nothing more to move


def test_the_setting_turns_the_forecast_prefetch_off(tmp_path: Path) -> None:
    node = Node(tmp_path, 8, forecast=False)
    try:
        soon = chain("alice", 1, 4)
        node.session("alice", "soon", soon, "stop")
        node.idle(310)
        node.session("alice", "later", chain("alice", 2, 8), "stop")
        node.idle(310)
        assert node.prefetch.tick() == 0
        node.prefetch.drain()
        assert node.fastest(soon) == ["disk"] * 4
        assert node.prefetch.request(("alice", "soon")).outcome == ACCEPTED  # explicit still
    finally:
        node.store.close()


def test_the_replay_scores_each_prefetch_mode_with_the_nodes_engine() -> None:
    ids = {"a": (1, 2, 3, 4), "b": (11, 12, 13, 14)}
    stops = {"a": "tool_use", "b": "end_turn"}  # "a" is back first, and forecast so
    times = [(0.0, "a"), (40.0, "b"), (90.0, "a"), (130.0, "b")]
    requests = [Request(t, s, ids[s], 4 * 64, stop=stops[s], duration=1.0) for t, s in times]
    trace = Trace("tiny", "agent-sessions", 64, requests, unique_blocks=8, sessions=2)
    report = run_replay(
        trace,
        capacity_frac=2.5,
        tiers=[("cpu", 1), ("disk", 4)],  # 4 blocks of memory: one chain at a time
        policies=["sessioncache"],
        prefetch=["none", "forecast", "oracle"],
    )
    out = report.to_json()["prefetch"]
    assert set(out) == {"none", "forecast", "oracle"}
    assert out["none"]["hit"] == report.results["sessioncache"].hit_rate
    assert out["oracle"]["cpu_share"] > out["none"]["cpu_share"]
    assert out["forecast"]["cpu_share"] > out["none"]["cpu_share"]
    assert out["forecast"]["hit"] == out["none"]["hit"] == out["oracle"]["hit"]


def test_a_full_queue_defers_and_the_worker_takes_tenants_in_turn(tmp_path: Path) -> None:
    node = Node(tmp_path, 16)
    node.prefetch = Prefetcher(
        node.store,
        node.sessions,
        budget=node.budget,
        tenant_of=lambda root: ROOTS.get(root, ""),
        tenant_queue=2,
    )
    try:
        chains = {
            (t, i): chain(t, 10 * (t == "bob") + i, 2) for t in ("alice", "bob") for i in range(3)
        }
        for (tenant, i), hashes in chains.items():
            node.session(tenant, f"s{i}", hashes, "stop")
        node.idle(310)
        node.session("carol", "c", chain("carol", 1, 16), "stop")  # everyone else to disk
        node.idle(310)
        asked = {key: node.prefetch.request((key[0], f"s{key[1]}")) for key in chains}
        assert [asked[("bob", i)].outcome for i in range(3)] == [ACCEPTED, ACCEPTED, DEFERRED]
        assert "queue" in asked[("bob", 2)].reason
        order: list[str] = []
        promote = node.store.prefetch.promote

        def watched(hashes: list[BlockHash], *args: object) -> object:
            order.append(next(t for (t, _), c in chains.items() if c == list(hashes)))
            return promote(hashes, *args)  # type: ignore[arg-type]

        node.store.prefetch.promote = watched  # type: ignore[method-assign]
        node.prefetch.drain()
        assert order == ["alice", "bob", "alice", "bob"]
    finally:
        node.store.close()


@pytest.mark.parametrize("forecast", [True, False])
def test_the_node_carries_the_engine_and_the_setting(tmp_path: Path, forecast: bool) -> None:
    settings = Settings(
        data_dir=tmp_path, cpu_bytes=1 << 20, disk_bytes=4 << 20, prefetch_forecast=forecast
    )
    node = open_node(settings, start=False)
    try:
        assert isinstance(node.prefetch, Prefetcher)
        assert node.prefetch.forecast_enabled is forecast
        assert node.store.tier_names()[node.prefetch.target or 0] == "cpu"
        node.sessions.open("s")
        assert node.prefetch.resident((OPEN_TENANT, "s")) == {"cpu": 0, "disk": 0}
        assert node.prefetch.request((OPEN_TENANT, "s")).outcome == REJECTED  # no chain yet
    finally:
        node.close()


def test_a_move_never_evicts_its_own_chain(node: Node) -> None:
    mine = chain("alice", 1, 6)
    node.session("alice", "s", mine, "stop")
    node.idle(7200)  # long overdue: its blocks are the first victims
    node.session("alice", "t", chain("alice", 2, 5), "tool_use")  # its tail goes to disk
    node.idle(310)
    assert node.fastest(mine) == ["cpu"] * 3 + ["disk"] * 3
    back = node.clock.now() + 0.5
    node.prefetch = Prefetcher(  # told the session is back now (a replay's oracle)
        node.store,
        node.sessions,
        budget=node.budget,
        tenant_of=lambda root: ROOTS.get(root, ""),
        returns=lambda key: back if key == ("alice", "s") else None,
    )
    assert node.prefetch.tick() == 1
    node.prefetch.drain()
    assert node.fastest(mine) == ["cpu"] * 6


def test_the_forecast_pass_forgets_closed_sessions(node: Node) -> None:
    soon = chain("alice", 1, 4)
    node.session("alice", "soon", soon, "stop")
    node.idle(310)
    node.session("alice", "later", chain("alice", 2, 8), "stop")
    node.idle(310)
    node.prefetch.tick()
    assert ("alice", "soon") in node.prefetch._lengths
    node.sessions.close("soon", tenant="alice")
    node.prefetch.tick()
    assert ("alice", "soon") not in node.prefetch._lengths
