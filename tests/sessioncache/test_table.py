"""The block table (struct of arrays by slot) and the index's whole-run lookup over it."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sessioncache.clock import ManualClock
from sessioncache.hashing import BlockHash
from sessioncache.store import TieredStore
from sessioncache.store.blocks import BlockMeta
from sessioncache.store.eviction import candidacy, evictable, is_spare, is_tail, spare_copy
from sessioncache.store.index import _MAX_RUNS
from sessioncache.store.table import NO_SLOT, BlockFields, BlockTable
from sessioncache.tiers.cpu import CpuTier

ROOT = b"\x07" * 16
SIZE = 64


def ids(tag: int, n: int) -> list[BlockHash]:
    return [BlockHash(tag.to_bytes(8, "big") + i.to_bytes(8, "big")) for i in range(n)]


def put(store: TieredStore, hashes: list[BlockHash], parent: BlockHash | None = None) -> None:
    store.writes.put(hashes, [h * 4 for h in hashes], namespace_root=ROOT, parent=parent)


def store_of(blocks: int = 10_000) -> tuple[TieredStore, ManualClock]:
    clock = ManualClock()
    return TieredStore([CpuTier(blocks * SIZE)], clock=clock), clock


def test_slots_are_reused_most_recently_freed_first_and_fields_reset() -> None:
    table = BlockTable(2, capacity=2)
    slots = [table.new(BlockFields(h, None, ROOT, 64, 10.0, 0.0, 0.0, 10.0)) for h in ids(1, 5)]
    assert slots == [0, 1, 2, 3, 4] and table.size == 5  # grown past its first capacity
    table.mask[2] = 3
    table.ref[2] = 1
    for slot in (4, 3, 2):  # a chain dropped tail first
        table.free(slot)
    assert len(table) == 2 and table.mask[2] == 0 and table.ref[2] == 0
    again = [table.new(BlockFields(h, None, ROOT, 64, 1.0, 0.0, 0.0, 1.0)) for h in ids(2, 3)]
    assert again == [2, 3, 4]  # back in chain order
    assert table.key(3) == ids(2, 3)[1] and table.slot_of[ids(2, 3)[1]] == 3
    assert table.children_in_of(3) == (0, 0) and table.first_kid[3] == NO_SLOT


def test_kid_lists_link_and_unlink_in_any_order() -> None:
    table = BlockTable(1)
    parent = table.new(BlockFields(ids(1, 1)[0], None, ROOT, 64, 1.0, 0.0, 0.0, 1.0))
    kids = [
        table.new(BlockFields(h, ids(1, 1)[0], ROOT, 64, 1.0, 0.0, 0.0, 1.0)) for h in ids(2, 4)
    ]
    for kid in kids:
        table.first_kid[parent] = table.push_kid(table.first_kid[parent], kid)
    assert sorted(table.kids(parent)) == kids
    for kid in (kids[2], kids[3], kids[0]):  # middle, head, tail
        table.first_kid[parent] = table.drop_kid(table.first_kid[parent], kid)
    assert list(table.kids(parent)) == [kids[1]]


def test_a_detached_record_reads_back_what_it_was_given() -> None:
    fields = BlockFields(
        b"\x01" * 16, b"\x02" * 16, ROOT, 64, 5.0, 1.0, 2.0, 7.0, ref_cnt=2, pins=1, mask=0b10
    )
    meta = BlockMeta.detached(fields, [1, 0])
    assert (meta.parent, meta.namespace_root, meta.nbytes, meta.ttl_s) == (
        b"\x02" * 16,
        ROOT,
        64,
        5.0,
    )
    assert (meta.created, meta.last_access, meta.expires_at) == (1.0, 2.0, 7.0)
    assert meta.children_in == (1, 0) and meta.tiers == {1} and meta.checksum is None
    copy = meta.copy()
    copy.checksum = 0  # a checksum of 0 is a checksum
    assert copy.checksum == 0 and meta.checksum is None and copy.ref_cnt == 2


@given(
    st.integers(0, 3),  # mask
    st.integers(0, 2),  # ref
    st.integers(0, 2),  # pins
    st.integers(0, 2),  # children held in tier 1
    st.integers(0, 2),  # children held anywhere
    st.integers(0, 2),  # tier
    st.booleans(),
)
def test_candidacy_agrees_with_the_policy_predicates(
    mask: int, ref: int, pins: int, here: int, held: int, tier: int, last: bool
) -> None:
    fields = BlockFields(
        b"\x01" * 16,
        None,
        ROOT,
        64,
        5.0,
        0.0,
        3.0,
        8.0,
        mask=mask & 0b11,
        ref_cnt=ref,
        pins=pins,
        children_held=held,
        touched_by_op=4,
        touch_order=9,
        next_use=11.0,
    )
    meta = BlockMeta.detached(fields, [here, here, here])
    spare, tail = candidacy(meta, tier, last=last)
    assert spare == spare_copy(meta, tier)
    assert tail == evictable(meta, tier, last=last)
    assert meta.order_keys() == (3.0, 8.0, 4, -9, 11.0)
    # the same rules over whole columns (the index's adoption) say the same of the block
    column = lambda v: np.array([v, 0, v], np.int64)  # noqa: E731
    assert is_tail(
        column(mask & 0b11), column(ref), column(here), column(held), tier, last
    ).tolist()[::2] == [tail, tail]
    assert is_spare(column(mask & 0b11), column(ref), column(pins), tier).tolist()[::2] == [
        spare,
        spare,
    ]
    # the rules spelled out: what may not leave, the tail rule, a spare copy
    held_here = bool((mask & 0b11) >> tier & 1)
    assert tail == (
        ref == 0 and held_here and here == 0 and (not last or held == 0 or mask & 0b11 == 0b11)
    )
    assert spare == (ref == pins and held_here and bool(mask & 0b11 & ((1 << tier) - 1)))


def test_a_chain_put_in_several_segments_is_matched_whole() -> None:
    store, _ = store_of()
    chain = ids(1, 300)
    for start in range(0, 300, 40):  # slots of other chains in between
        put(store, chain[start : start + 40], parent=chain[start - 1] if start else None)
        put(store, ids(100 + start, 7))
    match = store.reads.lookup(chain)
    assert match.hashes == chain and match.tiers == ["cpu"] * 300


def test_a_block_stored_again_elsewhere_continues_the_match() -> None:
    store, _ = store_of()
    chain = ids(1, 50)
    put(store, chain)
    put(store, ids(2, 5))
    assert store.writes.delete(chain[30:]) == 20  # tail first: those slots are freed
    put(store, ids(3, 20))  # takes the freed slots (stale ids overwritten)
    put(store, chain[30:], parent=chain[29])  # new slots
    assert store.reads.lookup(chain).hashes == chain
    assert store.reads.lookup(ids(3, 20)).hashes == ids(3, 20)


def test_a_freed_slot_never_matches_its_old_id() -> None:
    store, _ = store_of()
    chain = ids(1, 20)
    put(store, chain)
    store.writes.delete(chain[10:])
    assert store.reads.lookup(chain).hashes == chain[:10]
    put(store, chain[15:], parent=chain[14])  # not reachable: 10-14 are missing
    assert store.reads.lookup(chain).hashes == chain[:10]


def test_a_scattered_chain_is_matched_id_by_id() -> None:
    store, _ = store_of()
    chain = ids(1, 4 * _MAX_RUNS)
    for i, block in enumerate(chain):  # each block alone, another chain's block between
        put(store, [block], parent=chain[i - 1] if i else None)
        put(store, ids(1000 + i, 1))
    assert store.reads.lookup(chain).hashes == chain
    store.writes.delete(chain[-3:])
    assert store.reads.lookup(chain).hashes == chain[:-3]


def test_the_match_stops_at_an_expired_block_and_touches_only_the_match() -> None:
    clock = ManualClock()
    store = TieredStore([CpuTier(10_000 * SIZE)], clock=clock)
    chain = ids(1, 10)
    store.writes.put(chain[:6], [h * 4 for h in chain[:6]], namespace_root=ROOT, ttl_s=100.0)
    store.writes.put(
        chain[6:], [h * 4 for h in chain[6:]], namespace_root=ROOT, parent=chain[5], ttl_s=10.0
    )
    clock.advance(50.0)
    match = store.reads.lookup(chain, ttl_s=1000.0)
    assert match.hashes == chain[:6]
    touched = [store.reads.meta(h) for h in chain]
    assert all(m is not None and m.hit_count == 1 and m.ttl_s == 1000.0 for m in touched[:6])
    assert all(m is not None and m.hit_count == 0 for m in touched[6:])
    orders = [m.touch_order for m in touched[:6] if m is not None]
    assert orders == sorted(orders)  # root first: the tail is evicted first


@settings(max_examples=60, deadline=None)
@given(st.randoms(use_true_random=False))
def test_whole_run_lookup_agrees_with_a_block_by_block_walk(rnd: random.Random) -> None:
    store, clock = store_of(blocks=400)  # a small tier: evictions free and reuse slots
    chains = [ids(tag, rnd.randint(1, 60)) for tag in range(8)]
    for _ in range(40):
        chain = rnd.choice(chains)
        action = rnd.random()
        start = rnd.randrange(len(chain))
        if action < 0.5:
            put(store, chain[start:], parent=chain[start - 1] if start else None)
        elif action < 0.7:
            store.writes.delete(chain[start:])
        else:
            clock.advance(rnd.choice([0.0, 1.0]))
        probe = rnd.choice(chains)
        held = []
        for h in probe:
            if not store.reads.contains(h):
                break
            held.append(h)
        assert store.reads.lookup(probe).hashes == held
    slots = np.array(
        [store._core.index._table.slot_of[h] for h in store._core.index._table.slot_of]
    )
    assert len(set(slots.tolist())) == len(slots)


def _links(store: TieredStore) -> tuple[dict[bytes, tuple[object, ...]], dict[bytes, set[int]]]:
    index = store._core.index
    table = index._table
    # (a count of children in a tier the block has left is not kept: never read, and made
    # anew when it enters that tier again)
    state = {
        key: (
            table.held[slot],
            [
                n
                for tier, n in enumerate(table.children_in_of(slot))
                if table.mask[slot] >> tier & 1
            ],
            sorted(table.kids(slot)),
        )
        for key, slot in table.slot_of.items()
    }
    orphans = {parent: set(table.kids_from(first)) for parent, first in index._orphans.items()}
    return state, orphans


@settings(max_examples=40, deadline=None)
@given(st.randoms(use_true_random=False))
def test_relink_rebuilds_exactly_the_links_and_counts_kept_as_blocks_come_and_go(
    rnd: random.Random,
) -> None:
    clock = ManualClock()
    store = TieredStore([CpuTier(30 * SIZE), CpuTier(60 * SIZE, name="cpu2")], clock=clock)
    trunk = ids(1, 12)
    branches = [ids(10 + i, rnd.randint(1, 8)) for i in range(4)]
    for _ in range(30):
        action = rnd.random()
        if action < 0.4:
            cut = rnd.randrange(len(trunk))
            put(store, trunk[cut:], parent=trunk[cut - 1] if cut else None)
        elif action < 0.7:
            branch = rnd.choice(branches)
            put(store, branch, parent=rnd.choice(trunk))  # a branch off the trunk
        elif action < 0.85:
            store.writes.delete([rnd.choice(trunk + [b for br in branches for b in br])])
        else:
            block = rnd.choice(trunk)
            if store.reads.contains(block):
                store.reads.get(block)  # promotes it from the second tier
    before = _links(store)
    store._core.index.adoption.relink()
    assert _links(store) == before
