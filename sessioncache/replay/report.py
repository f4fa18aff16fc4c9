"""Human-readable report and the hit-rate-vs-capacity plot of a replay."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from sessioncache.replay.runner import ReplayReport

TARGET_VS_ORACLE = 1.10
"""The issue's target: sessioncache's misses at most 1.10x the oracle's (and fewer than LRU's)."""


def format_report(report: ReplayReport, *, span_days: float | None = None, seed: int = 0) -> str:
    trace = report.trace
    lines: list[str] = []
    where = ""
    if trace.kind == "agent-sessions" and span_days is not None:
        where = f", starts spread over {span_days:g} days (seed {seed})"
    lines.append(
        f"{trace.name} ({trace.kind}): {len(trace.requests):,} requests"
        + (f" in {trace.sessions} sessions" if trace.sessions else "")
        + f", {trace.total_tokens / 1e6:.1f}M input tokens, {trace.unique_blocks:,} unique"
        f" {trace.block_tokens}-token blocks{where}"
    )
    tiers = ", ".join(f"{name} {blocks:,}" for name, blocks in report.tiers)
    lines.append(
        f"capacity: {report.capacity_frac:.1%} of unique blocks = "
        f"{report.capacity_blocks:,} blocks ({tiers})"
    )
    lines.append("")
    tier_names = [name for name, _ in report.tiers]
    header = f"{'policy':<16}{'token hit':>10}{'miss tokens':>13}{'x oracle':>10}"
    header += "".join(f"{name:>9}" for name in tier_names) + f"{'time':>8}"
    lines.append(header)
    oracle = report.results.get("oracle")
    for name, r in report.results.items():
        ratio = (
            f"{r.miss_tokens / oracle.miss_tokens:.3f}" if oracle and oracle.miss_tokens else "-"
        )
        rates = r.tier_hit_rates()
        row = f"{name:<16}{r.hit_rate:>10.2%}{r.miss_tokens:>13,}{ratio:>10}"
        row += "".join(f"{rates[t]:>9.2%}" if t in rates else f"{'-':>9}" for t in tier_names)
        lines.append(row + f"{r.seconds:>7.1f}s")
    if any(r.miss_by_reason for r in report.results.values()):
        lines.append("")
        lines.append("missed tokens by reason, share of input tokens (docs/prompt-stability.md):")
        reasons = ("diverged", "evicted", "expired", "new")
        lines.append(f"{'policy':<16}" + "".join(f"{r:>10}" for r in reasons))
        for name, r in report.results.items():
            total = r.total_tokens or 1
            lines.append(
                f"{name:<16}"
                + "".join(f"{r.miss_by_reason.get(x, 0) / total:>10.2%}" for x in reasons)
            )
    if report.prefetch:
        lines.append("")
        lines.append(
            "prefetch (the node's default policy; cpu share: hit tokens from the first tier):"
        )
        lines.append(f"{'prefetch':<16}{'token hit':>10}{'cpu share':>11}")
        for mode, r in report.prefetch.items():
            lines.append(f"{mode:<16}{r.hit_rate:>10.2%}{r.first_tier_share:>11.2%}")
        closed = prefetch_gap_closed(report)
        if closed is not None:
            lines.append(
                f"forecast prefetch closes {closed:.2f} of the cpu share gap to the oracle"
            )
    verdicts = [v for v in (target_verdict(report), forecast_verdict(report)) if v]
    if verdicts:
        lines.append("")
        lines.extend(verdicts)
    return "\n".join(lines)


def prefetch_gap_closed(report: ReplayReport) -> float | None:
    """The share of the cpu share gap between no prefetch and the oracle's that the forecast
    prefetch closes; None without the three (or no gap)."""
    runs = report.prefetch
    if not all(k in runs for k in ("none", "forecast", "oracle")):
        return None
    none, oracle = runs["none"].first_tier_share, runs["oracle"].first_tier_share
    if oracle <= none:
        return None
    return (runs["forecast"].first_tier_share - none) / (oracle - none)


FORECAST_GAP_TARGET = 0.5
"""The forecast's target at tight capacity: sessioncache's misses at most halfway between
tail-first LRU's and Belady's (docs/sessions.md)."""
FORECAST_TARGET_FRACS = (0.01, 0.05)
"""The capacities (shares of the unique blocks) that target is set at."""


def gap_closed(report: ReplayReport, name: str = "sessioncache") -> float | None:
    """The share of the miss tokens between tail-first LRU and Belady that ``name`` saves: 0
    is LRU's, 1 Belady's, below 0 worse than LRU; None without both baselines (or no gap)."""
    results = report.results
    if not all(k in results for k in ("lru_tail_first", "belady", name)):
        return None
    lru, belady = results["lru_tail_first"].miss_tokens, results["belady"].miss_tokens
    if lru <= belady:
        return None
    return (lru - results[name].miss_tokens) / (lru - belady)


def forecast_verdict(report: ReplayReport) -> str | None:
    closed = gap_closed(report)
    if closed is None:
        return None
    lru = report.results["lru_tail_first"].miss_tokens
    ours = report.results["sessioncache"].miss_tokens
    target = ""
    if round(report.capacity_frac, 6) in FORECAST_TARGET_FRACS:
        met = "met" if closed >= FORECAST_GAP_TARGET else "NOT met"
        target = f" (>= {FORECAST_GAP_TARGET:.0%} at this capacity: {met})"
    return (
        f"forecast: sessioncache saves {closed:.0%} of the misses between lru_tail_first and "
        f"belady{target}; no more misses than lru_tail_first: {'yes' if ours <= lru else 'NO'}"
    )


def target_verdict(report: ReplayReport) -> str | None:
    results = report.results
    if not all(k in results for k in ("oracle", "lru", "sessioncache")):
        return None
    oracle, lru, ours = results["oracle"], results["lru"], results["sessioncache"]
    if not oracle.miss_tokens:
        return None
    ratio = ours.miss_tokens / oracle.miss_tokens
    ok_oracle = ratio <= TARGET_VS_ORACLE
    ok_lru = ours.miss_tokens < lru.miss_tokens
    return (
        f"target: sessioncache misses {ratio:.3f}x the oracle's (<= {TARGET_VS_ORACLE:.2f}x: "
        f"{'met' if ok_oracle else 'NOT met'}); fewer than lru's: {'yes' if ok_lru else 'NO'}"
    )


def write_plot(reports: Sequence[ReplayReport], path: Path, *, title: str) -> None:
    """Token hit rate vs capacity fraction, one line per policy. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = sorted(reports, key=lambda r: r.capacity_frac)
    fracs = [r.capacity_frac for r in ordered]
    names: list[str] = []
    for r in ordered:
        names.extend(n for n in r.results if n not in names)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in names:
        ys = [r.results[name].hit_rate if name in r.results else float("nan") for r in ordered]
        style = "--" if name in ("oracle", "belady") else "-"
        ax.plot(fracs, ys, style, marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("total capacity (fraction of unique blocks)")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, 1)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
