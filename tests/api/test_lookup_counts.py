"""What the lookup counters count over REST: the lookups engines ask, not a store's probe."""

from __future__ import annotations

from collections.abc import Mapping

import httpx

from tests.api.test_api import store_all, tokens, unique_ns

PROMPTS = 10
BT = 16
"""``unique_ns``' block size in tokens."""


def counters(client: httpx.Client) -> dict[str, int]:
    """``/v1/stats``' store counters (the dashboard's history samples the same ones)."""
    out: dict[str, int] = client.get("/v1/stats").json()["counters"]
    return out


def scraped(client: httpx.Client) -> dict[str, float]:
    """The unlabelled series of a ``/metrics`` scrape, by name."""
    out = {}
    for line in client.get("/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if not line.startswith("#") and "{" not in name and value:
            out[name] = float(value)
    return out


def grew(before: Mapping[str, float], after: Mapping[str, float], name: str) -> float:
    return after[name] - before[name]


def test_lookups_count_what_engines_ask_not_a_stores_probe(client: httpx.Client):
    """Ten prompts looked up, then stored (as an engine does after computing them), then
    looked up again: twenty lookups. Each ``POST /v1/store`` first looks up which blocks the
    node holds; that probe counts in neither the lookup counters nor the hit and miss
    figures."""
    ns = unique_ns()
    prompts = [tokens(100 + i, 3 * BT) for i in range(PROMPTS)]
    stats, scrape = counters(client), scraped(client)

    for toks in prompts:
        out = client.post("/v1/lookup", json={"namespace": ns, "tokens": toks}).json()
        assert out["matched_blocks"] == 0
        store_all(client, ns, toks)
    mid_stats, mid_scrape = counters(client), scraped(client)
    assert grew(stats, mid_stats, "lookups") == PROMPTS
    assert grew(scrape, mid_scrape, "sessioncache_lookups_total") == PROMPTS
    assert grew(stats, mid_stats, "hit_blocks") == 0
    assert grew(stats, mid_stats, "miss_blocks") == 3 * PROMPTS
    assert grew(scrape, mid_scrape, "sessioncache_hit_tokens_total") == 0
    assert grew(scrape, mid_scrape, "sessioncache_miss_tokens_total") == 3 * BT * PROMPTS

    for toks in prompts:  # stored again: every block held, nothing to upload, no lookup
        assert store_all(client, ns, toks)
    for toks in prompts:
        out = client.post("/v1/lookup", json={"namespace": ns, "tokens": toks}).json()
        assert out["matched_blocks"] == 3
    end_stats, end_scrape = counters(client), scraped(client)
    assert grew(stats, end_stats, "lookups") == 2 * PROMPTS
    assert grew(scrape, end_scrape, "sessioncache_lookups_total") == 2 * PROMPTS
    assert grew(mid_stats, end_stats, "hit_blocks") == 3 * PROMPTS
    assert grew(mid_stats, end_stats, "miss_blocks") == 0
    assert grew(mid_scrape, end_scrape, "sessioncache_hit_tokens_total") == 3 * BT * PROMPTS
    assert grew(mid_scrape, end_scrape, "sessioncache_miss_tokens_total") == 0
