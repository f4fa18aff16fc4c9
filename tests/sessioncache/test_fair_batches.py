"""The write-behind queue's order (``store.fair``): tenants in turn, weighted by bytes, each
tenant's items in the order queued, and a waiter's batch not topped up with others' backlog."""

from __future__ import annotations

import pytest

from sessioncache.store.fair import FairBatches

SLOT = 1 << 20  # batch_bytes / batch_items


def batches(q: FairBatches[str]) -> list[list[str]]:
    out = []
    while batch := q.take():
        out.append(batch)
    return out


def test_one_tenant_is_written_in_full_batches_in_order() -> None:
    q: FairBatches[str] = FairBatches(4, 4 * SLOT)
    for i in range(10):
        q.push("bob", f"b{i}", 4096)
    assert len(q) == 10
    assert batches(q) == [["b0", "b1", "b2", "b3"], ["b4", "b5", "b6", "b7"], ["b8", "b9"]]
    assert len(q) == 0


def test_a_batch_holds_at_most_batch_bytes_unless_one_item_is_larger() -> None:
    q: FairBatches[str] = FairBatches(4, 4 * SLOT)
    q.push("bob", "huge", 9 * SLOT)
    for i in range(3):
        q.push("bob", f"b{i}", 2 * SLOT)
    assert batches(q) == [["huge"], ["b0", "b1"], ["b2"]]


def test_tenants_take_turns_whatever_their_backlog_and_keep_their_order() -> None:
    q: FairBatches[str] = FairBatches(8, 8 * SLOT)
    for i in range(100):
        q.push("bob", f"b{i}", 4096)
    for i in range(3):
        q.push("alice", f"a{i}", 4096)
    first = q.take()
    assert first == ["b0", "a0", "b1", "a1", "b2", "a2", "b3", "b4"]
    rest = [item for batch in batches(q) for item in batch]
    assert rest == [f"b{i}" for i in range(5, 100)]


def test_turns_are_weighted_by_bytes_a_small_item_costing_one_slot() -> None:
    q: FairBatches[str] = FairBatches(64, 64 * SLOT)
    for i in range(20):
        q.push("bob", f"b{i}", 4 * SLOT)  # four slots each
        q.push("alice", f"a{i}", 4096)  # one slot each
    taken = q.take()  # four turns' credit for each of bob's items: alice's four between
    assert " ".join(taken[:14]) == "a0 a1 a2 b0 a3 a4 a5 a6 b1 a7 a8 a9 a10 b2"


def test_a_waiters_batch_ends_after_its_item_once_an_eighth_full() -> None:
    q: FairBatches[str] = FairBatches(16, 16 * SLOT)  # an eighth: two items
    for i in range(100):
        q.push("bob", f"b{i}", 4096)
    q.push("alice", "a-durable", 4096, urgent=True)
    q.push("alice", "a-later", 4096)
    assert q.take() == ["b0", "a-durable"]
    assert q.take() == ["b1", "a-later", *(f"b{i}" for i in range(2, 16))]


def test_a_waiters_batch_holds_an_eighth_of_a_batch_at_least() -> None:
    q: FairBatches[str] = FairBatches(64, 64 * SLOT)
    for i in range(100):
        q.push("alice", f"a{i}", 4096)
    q.push("bob", "b-durable", 4096, urgent=True)  # one small durable store after another
    assert q.take() == ["a0", "b-durable", *(f"a{i}" for i in range(1, 7))]


def test_waiters_of_several_tenants_share_a_batch() -> None:
    q: FairBatches[str] = FairBatches(8, 8 * SLOT)
    for i in range(100):
        q.push("bob", f"b{i}", 4096)
    q.push("alice", "a", 4096, urgent=True)
    q.push("carol", "c", 4096, urgent=True)
    q.push("bob", "b-durable", 4096, urgent=True)  # behind his own backlog
    assert q.take() == ["b0", "a", "c"]
    taken = [item for batch in batches(q) for item in batch]
    assert taken[-1] == "b-durable"


def test_a_waiters_blocks_share_one_batch_with_one_slot_of_the_others_between() -> None:
    q: FairBatches[str] = FairBatches(8, 8 * SLOT)
    for i in range(100):
        q.push("bob", f"b{i}", 4096)
    for i in range(3):
        q.push("alice", f"a{i}", 4096, urgent=True)
    assert q.take() == ["b0", "a0", "b1", "a1", "b2", "a2"]


def test_floods_of_durable_stores_take_no_more_than_their_turns() -> None:
    q: FairBatches[str] = FairBatches(64, 64 * SLOT)
    tenants = {"bob": True, "carol": True, "alice": False, "dave": False}  # urgent or not
    for _ in range(1000):
        for tenant, urgent in tenants.items():
            q.push(tenant, tenant, 4096, urgent=urgent)
    sizes = []
    taken = {tenant: 0 for tenant in tenants}
    for _ in range(20):
        batch = q.take()
        sizes.append(len(batch))
        for tenant in batch:
            taken[tenant] += 1
    assert min(taken.values()) >= max(taken.values()) - 1
    assert min(sizes) >= 60  # batches stay full: cut after the last waited-for item


def test_a_tenant_that_left_the_round_rejoins_at_its_end_without_credit() -> None:
    q: FairBatches[str] = FairBatches(2, 2 * SLOT)
    q.push("alice", "a0", 4096)
    q.push("bob", "b0", 4096)
    assert q.take() == ["a0", "b0"]
    for i in range(1, 4):
        q.push("bob", f"b{i}", 4096)
    q.push("alice", "a1", 4096)
    assert batches(q) == [["b1", "a1"], ["b2", "b3"]]


def test_batch_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        FairBatches(0, SLOT)
