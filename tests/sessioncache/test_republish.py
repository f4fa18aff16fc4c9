"""What the shared tier missed while down is recorded per tenant, bounded per tenant, and
taken back tenant by tenant (the end-to-end case, with a real Redis killed and restarted under
two nodes, is tests/faults/test_redis_restart.py)."""

from __future__ import annotations

from pathlib import Path

from sessioncache.clock import ManualClock
from sessioncache.hashing import BlockHash, Namespace, block_hashes
from sessioncache.redis_link import make_client
from sessioncache.store import TieredStore
from sessioncache.store.republish import Republisher
from sessioncache.tiers.cpu import CpuTier
from sessioncache.tiers.disk import DiskTier
from sessioncache.tiers.redis import RedisTier
from tests.support.servers import free_port

ALICE = Namespace("republish", 4, "u8", "alice")
BOB = Namespace("republish", 4, "u8", "bob")
SIZE = 4096


def owner(root: bytes) -> str:
    return "bob" if root == BOB.root() else "alice"


def stored(store: TieredStore, ns: Namespace, blocks: int) -> list[BlockHash]:
    hashes = block_hashes(ns, list(range(blocks * ns.block_tokens)))
    store.writes.put(hashes, [bytes(h) * (SIZE // 16) for h in hashes], namespace_root=ns.root())
    return hashes


def test_a_tenant_flooding_the_record_keeps_to_its_share_and_the_other_is_taken_in_turn() -> None:
    store = TieredStore([CpuTier(64 * SIZE, chunk_bytes=16 * SIZE)], clock=ManualClock())
    alice = stored(store, ALICE, 20)
    bob = stored(store, BOB, 2)
    core = store._core
    republisher = Republisher(core, 0, owner, bound_blocks=10, interval_s=3600)
    try:
        for h in alice + bob:
            meta = core.index.get(h)
            assert meta is not None
            republisher.note(meta)
        assert (republisher.pending, republisher.dropped) == (7, 15)  # alice keeps her last 5
        taken = [h for _, h in republisher._take(4)]
        assert taken == [alice[15], bob[0], alice[16], bob[1]]
        assert [h for _, h in republisher._take(10)] == alice[17:]
        assert republisher.pending == 0
    finally:
        republisher.close()
        store.close()


def test_a_full_disk_still_evicts_by_policy_while_the_shared_tier_below_it_is_down(
    tmp_path: Path,
) -> None:
    """The tier below the disk is the shared one (Redis, here a server that is not there): a
    disk victim it cannot take was held on disk and leaves it by policy, as from a full
    budget; only a copy in memory that the disk cannot take stays. Stores go on, every one
    held on a tier of this node, and what the shared tier missed is recorded for later."""
    redis = RedisTier(make_client(f"redis://127.0.0.1:{free_port()}/0"), 1 << 30, prefix="down")
    store = TieredStore(
        [CpuTier(4 * SIZE, chunk_bytes=4 * SIZE), DiskTier(tmp_path, 8 * SIZE), redis],
        clock=ManualClock(),
        write_through=["redis"],
        write_behind_bytes=1 << 20,
        write_behind_owner=owner,
    )
    try:
        for i in range(10):
            ns = Namespace("republish", 4, "u8", f"chain-{i}")
            hashes = block_hashes(ns, list(range(2 * ns.block_tokens)))
            result = store.writes.put(
                hashes, [bytes(h) * (SIZE // 16) for h in hashes], namespace_root=ns.root()
            )
            assert not result.dropped, (i, result)
        assert store.write_behind is not None and store.write_behind.flush(30)
        assert store.republisher is not None and store.republisher.pending == 20
    finally:
        store.close()


def test_the_record_is_bounded_in_all_and_a_failed_step_puts_its_blocks_back_first() -> None:
    carol_ns = Namespace("republish", 4, "u8", "carol")
    owners = {ALICE.root(): "alice", BOB.root(): "bob", carol_ns.root(): "carol"}
    store = TieredStore([CpuTier(64 * SIZE, chunk_bytes=16 * SIZE)], clock=ManualClock())
    alice, bob, carol = (stored(store, ns, 5) for ns in (ALICE, BOB, carol_ns))
    core = store._core
    republisher = Republisher(core, 0, lambda root: owners[root], bound_blocks=10, interval_s=3600)
    try:
        for h in alice + bob + carol[:1]:
            meta = core.index.get(h)
            assert meta is not None
            republisher.note(meta)
        # 11 records past a bound of 10: the tenant holding the most loses its oldest
        assert (republisher.pending, republisher.dropped) == (10, 1)
        taken = republisher._take(3)
        assert [h for _, h in taken] == [alice[1], bob[0], carol[0]]
        for tenant, h in reversed(taken):  # as a failed step puts them back
            republisher._record(tenant, [h], front=True)
        assert [h for _, h in republisher._take(3)] == [alice[1], bob[0], carol[0]]
    finally:
        republisher.close()
        store.close()
