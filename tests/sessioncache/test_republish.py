"""What the shared tier missed while down is recorded per tenant, bounded per tenant, and
taken back tenant by tenant (the end-to-end case, with a real Redis killed and restarted under
two nodes, is tests/faults/test_redis_restart.py)."""

from __future__ import annotations

from sessioncache.clock import ManualClock
from sessioncache.hashing import BlockHash, Namespace, block_hashes
from sessioncache.store import TieredStore
from sessioncache.store.republish import Republisher
from sessioncache.tiers.cpu import CpuTier

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
        taken = republisher._take(4)
        assert taken == [alice[15], bob[0], alice[16], bob[1]]
        assert republisher._take(10) == alice[17:]
        assert republisher.pending == 0
    finally:
        republisher.close()
        store.close()
