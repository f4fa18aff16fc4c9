"""What the store tells the dashboard: bytes loaded, usage per namespace, a chain's tiers."""

from __future__ import annotations

from sessioncache.hashing import BlockHash
from sessioncache.store import TieredStore
from sessioncache.tiers.cpu import CpuTier

ROOT_A = b"a" * 16
ROOT_B = b"b" * 16


def bid(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def chain(store: TieredStore, start: int, n: int, root: bytes, size: int) -> list[BlockHash]:
    hashes = [bid(start + i) for i in range(n)]
    for i, h in enumerate(hashes):
        store.writes.put(
            [h], [bytes(size)], namespace_root=root, parent=hashes[i - 1] if i else None
        )
    return hashes


def test_namespace_usage_and_loaded_bytes():
    store = TieredStore([CpuTier(1 << 20), CpuTier(1 << 20, name="cpu2")])
    a = chain(store, 0, 3, ROOT_A, 100)
    chain(store, 100, 2, ROOT_B, 50)
    usage = store.namespace_usage()
    assert (usage[ROOT_A].blocks, usage[ROOT_A].bytes) == (3, 300)
    assert (usage[ROOT_B].blocks, usage[ROOT_B].bytes) == (2, 100)
    assert store.counters().loaded_bytes == 0
    store.reads.get_bytes(a[0])
    store.reads.get(a[1])
    assert store.counters().loaded_bytes == 200
    store.writes.delete([a[2]])
    assert store.namespace_usage()[ROOT_A].blocks == 2


def test_chain_tiers():
    store = TieredStore([CpuTier(1 << 20), CpuTier(1 << 20, name="cpu2")])
    a = chain(store, 0, 3, ROOT_A, 100)
    got = store.reads.chain_tiers(a[-1])
    assert [meta.block_hash for meta, _ in got] == a
    assert [tiers for _, tiers in got] == [["cpu"]] * 3
    assert store.reads.chain_tiers(bid(999)) == []
