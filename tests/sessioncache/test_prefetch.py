"""Prefetch (``sessions.prefetch``, ``store.prefetch``): a session's chain moved up from disk
into the CPU tier on request and ahead of its forecast return; a grant admitted against the
tenant's share, evicting only what returns later and never a pinned block of anyone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from sessioncache.clock import ManualClock
from sessioncache.errors import SessionNotFound
from sessioncache.hashing import BlockHash, Namespace, block_hashes
from sessioncache.quotas import PinBudget
from sessioncache.sessions.manager import SessionManager
from sessioncache.sessions.prefetch import ACCEPTED, Prefetcher
from sessioncache.store import TieredStore
from sessioncache.store.eviction import EvictionPolicy
from sessioncache.tiers.cpu import CpuTier
from sessioncache.tiers.disk import DiskTier

SIZE = 64
NAMESPACES = {tenant: Namespace(f"model-{tenant}", 4, "u8", "x") for tenant in ("alice", "bob")}
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
            EvictionPolicy.named("forecast", 2),
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
