"""The eviction policy on its own: admission as a pure function of the records, victim order."""

from __future__ import annotations

from sessioncache.hashing import BlockHash
from sessioncache.store.blocks import BlockMeta, tier_mask
from sessioncache.store.eviction import EvictionPolicy
from sessioncache.store.forecast import Forecast
from sessioncache.store.table import BlockFields

TIERS = 2


def meta(
    n: int,
    *,
    tiers: set[int],
    last_access: float,
    parent: int | None = None,
    expires_at: float = 1e9,
    ref_cnt: int = 0,
) -> BlockMeta:
    fields = BlockFields(
        block_hash=BlockHash(bytes([n]) * 16),
        parent=BlockHash(bytes([parent]) * 16) if parent is not None else None,
        namespace_root=b"\0" * 16,
        nbytes=64,
        ttl_s=3600.0,
        created=0.0,
        last_access=last_access,
        expires_at=expires_at,
        ref_cnt=ref_cnt,
        mask=tier_mask(tiers),
    )
    return BlockMeta.detached(fields, [0] * TIERS)


def test_a_new_block_colder_than_the_victim_is_not_admitted():
    policy = EvictionPolicy(TIERS)
    victim = meta(1, tiers={0}, last_access=10.0)
    assert not policy.admits(victim, meta(2, tiers=set(), last_access=5.0), 0, now=20.0)
    assert policy.admits(victim, meta(3, tiers=set(), last_access=15.0), 0, now=20.0)


def test_an_expired_or_spare_victim_always_makes_room():
    policy = EvictionPolicy(TIERS)
    cold = meta(2, tiers=set(), last_access=5.0)
    assert policy.admits(meta(1, tiers={0}, last_access=10.0, expires_at=20.0), cold, 0, 20.0)
    assert policy.admits(meta(1, tiers={0, 1}, last_access=10.0), cold, 1, 20.0)


def test_a_demoted_block_is_not_judged_again():
    policy = EvictionPolicy(TIERS)
    victim = meta(1, tiers={1}, last_access=10.0)
    demoted = meta(2, tiers={0}, last_access=5.0)  # still held above while it is copied down
    assert policy.admits(victim, demoted, 1, now=20.0)
    assert not policy.admits(victim, meta(3, tiers=set(), last_access=5.0), 1, now=20.0)


def test_the_last_copy_of_the_incoming_blocks_parent_is_not_given_up_for_it():
    policy = EvictionPolicy(TIERS)
    parent = meta(1, tiers={1}, last_access=10.0)
    child = meta(2, tiers={0}, last_access=15.0, parent=1)
    assert not policy.admits(parent, child, 1, now=20.0)
    above = meta(3, tiers={0}, last_access=10.0)
    assert policy.admits(above, meta(4, tiers=set(), last_access=15.0, parent=3), 0, now=20.0)


def test_victims_come_expired_first_then_spare_copies_then_least_recently_used():
    policy = EvictionPolicy(TIERS)
    blocks = {
        m.block_hash: m
        for m in (
            meta(1, tiers={1}, last_access=1.0),
            meta(2, tiers={0, 1}, last_access=3.0),  # a spare copy in tier 1
            meta(3, tiers={1}, last_access=4.0, expires_at=10.0),
            meta(4, tiers={1}, last_access=2.0, ref_cnt=1),  # pinned: never a victim
        )
    }
    for m in blocks.values():
        policy.track(m, 1)
    order = []
    while (victim := policy.next_victim(1, 20.0, blocks.get)) is not None:
        order.append(victim.block_hash[0])
        del blocks[victim.block_hash]  # evicted: its other entries are stale
    assert order == [3, 2, 1]


def test_a_victim_is_demoted_unless_expired_at_the_bottom_or_held_in_another_tier() -> None:
    policy = EvictionPolicy(TIERS)
    assert policy.demotes(meta(1, tiers={0}, last_access=1.0), 0, now=20.0)
    assert not policy.demotes(meta(2, tiers={0}, last_access=1.0, expires_at=5.0), 0, 20.0)
    assert not policy.demotes(meta(3, tiers={0, 1}, last_access=1.0), 0, now=20.0)  # spare
    assert not policy.demotes(meta(4, tiers={1}, last_access=1.0), 1, now=20.0)  # the last


def test_a_spare_copy_of_the_incoming_blocks_parent_makes_room_for_it():
    """A spare copy comes up first whatever its chain's forecast, and its block stays held in
    the faster tier: refusing the child for it would drop the child (a demotion refused)."""
    for policy in (EvictionPolicy(TIERS), EvictionPolicy(TIERS, Forecast())):
        parent = meta(1, tiers={0, 1}, last_access=10.0)
        child = meta(2, tiers={0}, last_access=15.0, parent=1)  # being demoted
        assert policy.admits(parent, child, 1, now=20.0)
        assert policy.admits(parent, meta(3, tiers=set(), last_access=5.0, parent=1), 1, 20.0)
        only = meta(4, tiers={1}, last_access=10.0)
        assert not policy.admits(only, meta(5, tiers={0}, last_access=15.0, parent=4), 1, 20.0)
