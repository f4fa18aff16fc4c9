"""``sessioncache replay PATH``: replay a trace through the production policy and baselines.

PATH is a Mooncake JSONL trace or a folder of agentic session files. The command prints the
token hit rate of an infinite cache (the oracle), a plain LRU, a 5-minute sliding TTL and
sessioncache's default policy at the same capacity, overall and per tier; ``--json`` prints
``{"oracle": rate, "lru": .., "ttl_5min": .., "sessioncache": .., "detail": {...}}`` instead
(one key per policy run), and with ``--prefetch none,forecast,oracle`` a ``"prefetch"`` object:
per mode, the node's default policy with that prefetch, its ``cpu_share`` (hit tokens served
from the first tier over all hit tokens) and ``hit`` (its token hit rate). A progress bar
goes to stderr when it is a terminal. ``--plot`` also writes a PNG of hit rate vs capacity
(needs matplotlib). See ``sessioncache.replay``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

DEFAULT_PLOT_FRACS = "0.01,0.02,0.05,0.1,0.2,0.5"


def _fracs(text: str) -> list[float]:
    try:
        fracs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of fractions: {text!r}") from None
    if not fracs or any(not f > 0 for f in fracs):
        raise argparse.ArgumentTypeError("capacity fractions must be positive")
    return fracs


def _modes(text: str) -> list[str]:
    modes = [x.strip() for x in text.split(",") if x.strip()]
    allowed = ("none", "forecast", "oracle")
    for mode in modes:
        if mode not in allowed:
            raise argparse.ArgumentTypeError(f"prefetch modes are {', '.join(allowed)}")
    return modes


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


@contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    if not enabled:
        yield None
        return
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a nicety: run without it
        yield None
        return
    bar = tqdm(total=total, unit="req", file=sys.stderr, desc="replay", dynamic_ncols=True)
    try:
        yield bar.update
    finally:
        bar.close()


def _codec_table(raw: dict[str, float], coded: dict[str, float], ratio: float, rep: Any) -> str:
    tiers = ", ".join(f"{n} {b}" for n, b in rep.tiers)
    lines = [
        f"at the same disk bytes, blocks stored {ratio:g}x smaller (blocks per tier: {tiers}):",
        f"  {'policy':16} {'raw':>8} {'coded':>8} {'gain':>8}",
    ]
    for name, rate in raw.items():
        lines.append(
            f"  {name:16} {rate:8.2%} {coded[name]:8.2%} {100 * (coded[name] - rate):+7.2f}pt"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from sessioncache.errors import InvalidInput
    from sessioncache.replay.report import format_report, write_plot
    from sessioncache.replay.runner import (
        EXTRA_POLICIES,
        POLICIES,
        parse_tiers,
        run_capacity_sweep,
        run_replay,
    )
    from sessioncache.replay.trace import load_trace

    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                "--plot needs matplotlib, which is not installed: pip install matplotlib",
                file=sys.stderr,
            )
            return 2
    policies = [*POLICIES] if args.policies is None else list(args.policies)
    for extra in args.extra:
        if extra not in policies:
            policies.append(extra)
    started = time.perf_counter()
    try:
        tiers = parse_tiers(args.tiers)
        for name in policies:
            if name not in (*POLICIES, *EXTRA_POLICIES):
                raise InvalidInput(f"unknown policy {name!r}")
        trace = load_trace(
            args.path,
            span_days=args.span_days,
            seed=args.seed,
            block_tokens=args.block_tokens,
            half=args.half,
        )
    except InvalidInput as exc:
        print(f"sessioncache replay: {exc}", file=sys.stderr)
        return 2
    if not trace.requests:
        print(f"sessioncache replay: {args.path} has no requests", file=sys.stderr)
        return 2
    plot_fracs = [f for f in args.plot_fracs if f != args.capacity_frac] if args.plot else []
    runs = 1 + len(plot_fracs)
    total = len(trace.requests) * (
        len(policies) + (runs - 1) * (len(policies) - 1) + len(args.prefetch)
    )
    show = not args.no_progress and sys.stderr.isatty()
    with _progress(total, show) as progress:
        report = run_replay(
            trace,
            capacity_frac=args.capacity_frac,
            tiers=tiers,
            policies=policies,
            progress=progress,
            prefetch=args.prefetch,
        )
        sweep = (
            run_capacity_sweep(
                trace,
                plot_fracs,
                tiers=tiers,
                policies=policies,
                progress=progress,
                oracle=report.results.get("oracle"),
            )
            if args.plot
            else []
        )
    coded = None
    if args.codec_ratio is not None:
        try:
            coded = run_replay(
                trace,
                capacity_frac=args.capacity_frac,
                tiers=tiers,
                policies=policies,
                oracle=report.results.get("oracle"),
                codec_ratio=args.codec_ratio,
            )
        except InvalidInput as exc:
            print(f"sessioncache replay: {exc}", file=sys.stderr)
            return 2
    if args.plot is not None:
        title = f"{trace.name}: token hit rate vs capacity"
        write_plot([report, *sweep], Path(args.plot), title=title)
    wall = time.perf_counter() - started
    if args.json:
        out: dict[str, Any] = report.to_json()
        out["detail"]["span_days"] = args.span_days if trace.kind == "agent-sessions" else None
        out["detail"]["seed"] = args.seed
        out["detail"]["wall_s"] = round(wall, 2)
        if coded is not None:
            out["codec"] = {
                "ratio": args.codec_ratio,
                "tiers": coded.tiers,
                "hit_rates": coded.hit_rates(),
            }
        if sweep:
            out["detail"]["capacity_sweep"] = {
                str(r.capacity_frac): r.hit_rates()
                for r in sorted([report, *sweep], key=lambda r: r.capacity_frac)
            }
        print(json.dumps(out, indent=2))
    else:
        print(format_report(report, span_days=args.span_days, seed=args.seed))
        if coded is not None:
            print(_codec_table(report.hit_rates(), coded.hit_rates(), args.codec_ratio, coded))
        if args.plot is not None:
            print(f"plot: {args.plot}")
        print(f"wall time: {wall:.1f}s")
    return 0


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "replay",
        help="replay a request trace: token hit rate of sessioncache vs oracle, LRU, 5-min TTL",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", help="a Mooncake JSONL trace, or a folder of session files")
    parser.add_argument(
        "--span-days",
        type=float,
        default=3.0,
        help="spread session start times over this many days (session folders; default 3)",
    )
    parser.add_argument(
        "--capacity-frac",
        type=_positive,
        default=0.05,
        help="total capacity as a fraction of the trace's unique blocks (default 0.05)",
    )
    parser.add_argument(
        "--tiers",
        default="cpu:1",
        help="tier names and capacity weights, fastest first, the same for every policy "
        "(default 'cpu:1'; the service's default layout is 'cpu:1,disk:16')",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of session start times")
    parser.add_argument(
        "--block-tokens",
        type=int,
        default=None,
        help="tokens per block of a JSONL trace (default 512); session files give theirs",
    )
    parser.add_argument(
        "--extra",
        type=lambda s: [x for x in s.split(",") if x],
        default=["lru_tail_first", "belady"],
        help="further baselines: lru_tail_first, belady (clairvoyant), sessioncache_lru (the "
        "node under SESSIONCACHE_EVICTION_POLICY=lru); default lru_tail_first,belady",
    )
    parser.add_argument(
        "--half",
        choices=("even", "odd"),
        default=None,
        help="session folders: replay only the even- or odd-numbered files (by name), to tune "
        "on one half of a sample and report on the other",
    )
    parser.add_argument(
        "--prefetch",
        type=_modes,
        default=[],
        help="also replay the node's default policy with each prefetch mode: none, forecast "
        "(the node's forecast prefetch), oracle (knowing each return); reports cpu_share (hit "
        "tokens from the first tier / all hit tokens) and hit per mode",
    )
    parser.add_argument(
        "--policies",
        type=lambda s: [x for x in s.split(",") if x],
        default=None,
        help="the policies to replay instead of oracle,lru,ttl_5min,sessioncache (with "
        "--extra's added)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--plot", metavar="PNG", default=None, help="also write hit rate vs capacity to PNG"
    )
    parser.add_argument(
        "--plot-fracs",
        type=_fracs,
        default=_fracs(DEFAULT_PLOT_FRACS),
        help=f"capacity fractions of the plot (default {DEFAULT_PLOT_FRACS})",
    )
    parser.add_argument(
        "--codec-ratio",
        type=_positive,
        default=None,
        help="also replay with the disk and Redis tiers holding this many times more blocks "
        "in the same bytes: a block codec's measured ratio (bench/kv_codec.py)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)
