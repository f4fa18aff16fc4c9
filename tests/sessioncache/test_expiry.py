"""``ExpiryIndex``: a sweep visits what is due, re-filing what moved later."""

from __future__ import annotations

from sessioncache.store.expiry import ExpiryIndex


def test_due_returns_the_expired_and_refiles_the_moved():
    index: ExpiryIndex[str] = ExpiryIndex(width=1.0)
    expires = {"a": 5.0, "b": 7.5, "c": 100.0}
    for key, at in expires.items():
        index.add(key, at)
    visited: list[str] = []

    def check(key: str, now: float) -> tuple[str | None, float | None]:
        visited.append(key)
        at = expires.get(key)
        if at is None:
            return None, None
        return (key, None) if at <= now else (None, at)

    assert index.due(4.0, check) == [] and visited == []
    expires["a"] = 50.0  # touched: slides later
    assert index.due(8.0, check) == ["b"]
    assert sorted(visited) == ["a", "b"]  # never "c": not due
    visited.clear()
    assert index.due(8.0, check) == [] and visited == []  # "b" is gone, "a" re-filed at 50
    assert index.due(60.0, check) == ["a"]
    assert index.due(1000.0, check) == ["c"]
    assert len(index) == 0


def test_a_key_due_again_now_waits_for_the_next_sweep_and_duplicates_count_once():
    index: ExpiryIndex[str] = ExpiryIndex(width=10.0)
    index.add("pinned", 1.0)
    index.add("pinned", 2.0)
    calls: list[str] = []

    def check(key: str, now: float) -> tuple[str | None, float | None]:
        calls.append(key)
        return None, now  # expired but pinned: ask again next sweep

    assert index.due(5.0, check) == [] and calls == ["pinned"]
    assert index.due(5.0, check) == [] and calls == ["pinned", "pinned"]
