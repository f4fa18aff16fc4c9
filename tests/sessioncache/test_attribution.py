"""``classify`` and ``DropLog`` on their own: every missed block gets one reason, the counts
add up, and the rings stay bounded."""

from __future__ import annotations

from sessioncache.attribution import (
    Attribution,
    DropLog,
    Lookup,
    PreviousPrompt,
    StoreView,
    classify,
    divergence_block,
)
from sessioncache.hashing import BlockHash
from sessioncache.store.blocks import BlockMeta
from sessioncache.store.table import BlockFields

ROOT = b"r" * 16
BT = 4


def ids(tag: int, n: int, start: int = 0) -> list[BlockHash]:
    return [BlockHash(bytes([tag]) + i.to_bytes(15, "little")) for i in range(start, start + n)]


def meta(h: BlockHash, expires_at: float = 100.0, root: bytes = ROOT) -> BlockMeta:
    return BlockMeta.detached(BlockFields(h, None, root, 64, 10.0, 0.0, 0.0, expires_at))


def view(held: dict[BlockHash, BlockMeta] | None = None, now: float = 50.0) -> StoreView:
    held = held or {}
    return StoreView(held.get, lambda h: ["cpu"] if h in held else [], lambda: now)


def test_divergence_block_is_the_first_differing_id():
    prev = ids(1, 10)
    assert divergence_block(prev[:6] + ids(2, 7, 6), b"".join(prev)) == 6
    assert divergence_block(ids(2, 3), b"".join(prev)) == 0
    assert divergence_block(prev[:4], b"".join(prev)) is None  # a prefix: no divergence
    assert divergence_block(prev + ids(3, 2), b"".join(prev)) is None  # growth


def test_every_missed_block_has_one_reason_and_the_counts_add_up():
    drops = DropLog(ring_blocks=100)
    prev = ids(1, 10)
    for h in prev[3:5]:
        drops.block_dropped(meta(h), "disk", 40.0)
    drops.block_dropped(meta(prev[5], expires_at=30.0), "cpu", 45.0)
    # the same ids as before up to block 6, then other content, then two blocks of growth
    hashes = prev[:6] + ids(2, 6, 6)
    lookup = Lookup(ROOT, hashes, 3, BT, len(hashes) * BT + 3)
    report = classify(view(), drops, lookup, PreviousPrompt(b"".join(prev), held=10))
    first = report.first
    assert first is not None and first.reason == "evicted" and first.tier == "disk"
    assert first.ago_s == 10.0 and first.pressure == "capacity"
    expected = {
        "evicted": 2 * BT,
        "expired": BT,
        "diverged": 4 * BT,
        "new": 2 * BT + 3,
        "declined": 0,
    }
    assert report.tokens == expected
    assert report.divergence is not None and report.divergence.lost_blocks == 4


def test_held_blocks_behind_a_hole_take_its_reason_and_expired_ones_say_so():
    hashes = ids(1, 6)
    held = {h: meta(h, expires_at=20.0) for h in hashes[:3]}
    report = classify(view(held), DropLog(), Lookup(ROOT, hashes, 0, BT, 6 * BT))
    assert report.first is not None and report.first.reason == "expired"
    assert report.first.ago_s == 30.0
    assert report.tokens["expired"] == 3 * BT and report.tokens["new"] == 3 * BT


def test_another_roots_drops_are_not_reported():
    drops = DropLog()
    hashes = ids(1, 2)
    drops.block_dropped(meta(hashes[0], root=b"o" * 16), "cpu", 1.0)
    report = classify(view(), drops, Lookup(ROOT, hashes, 0, BT, 2 * BT))
    assert report.first is not None and report.first.reason == "new"


def test_rings_and_sessions_are_bounded():
    drops = DropLog(ring_blocks=3)
    for h in ids(1, 10):
        drops.block_dropped(meta(h), "cpu", 1.0)
    assert drops.size() == {"cpu": 3}
    assert drops.find(ids(1, 1)[0]) is None and drops.find(ids(1, 1, 9)[0]) is not None
    attribution = Attribution(view(), drops, max_sessions=2)
    for sid in "abc":
        attribution.lookup(Lookup(ROOT, ids(2, 2), 0, BT, 2 * BT), session=("t", sid))
    assert attribution.session_totals(("t", "a")).lookups == 0  # dropped, the oldest
    assert attribution.session_totals(("t", "c")).lookups == 1
    assert attribution.session_totals(("other", "c")).lookups == 0
    assert sum(attribution.miss_tokens().values()) == 3 * 2 * BT
