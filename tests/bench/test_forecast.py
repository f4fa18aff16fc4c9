"""``bench.forecast``'s verdict: each fold is judged at each capacity on its own."""

from __future__ import annotations

from bench.forecast import Cell, verdict


def test_a_folds_savings_at_one_capacity_do_not_hide_its_loss_at_another():
    cells = [
        Cell("0", 0, 0.01, "default", lru=1000, belady=800, ours=900),  # saves 100
        Cell("0", 0, 0.05, "default", lru=100, belady=90, ours=102),  # 2% more misses
    ]
    line = next(x for x in verdict(cells, 1) if "worst fold" in x)
    assert "2.000% of its miss tokens" in line and "MISSED" in line
