"""``sessioncache stats [--url U] [--watch]``: the dashboard's overview as a terminal table.

Reads ``GET /admin/api/overview`` with the admin token (``--token``, else
``SESSIONCACHE_ADMIN_TOKEN``; none needed when the service runs open on loopback). With
``--watch`` the table is redrawn every ``--interval`` seconds until Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8080"


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _num(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def table(rows: Sequence[Sequence[str]], header: Sequence[str] | None = None) -> str:
    """Left-aligned columns separated by two spaces."""
    all_rows = [list(header)] if header else []
    all_rows += [list(r) for r in rows]
    if not all_rows:
        return ""
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(all_rows[0]))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in all_rows
    ]
    if header:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render(o: dict[str, Any], url: str) -> str:
    """The overview as text: headline figures, tiers, fleet and problems."""
    prefill, counters = o["prefill"], o["counters"]
    rates = o.get("rates") or {}
    latency = o["lookup_latency_s"]

    def ms(v: float | None) -> str:
        return _num(None if v is None else v * 1000, "{:.2f} ms")

    figures = [
        ("prefill saved", f"{prefill['gpu_seconds_saved']:.3f} GPU-s"),
        ("hit tokens", str(prefill["hit_tokens"])),
        ("computed tokens", str(prefill["computed_tokens"])),
        ("token hit rate", _num(_pct(prefill["hit_rate"]), "{:.1f} %")),
        ("lookups/s", _num(rates.get("lookups_per_s"))),
        ("stores/s", _num(rates.get("stores_per_s"))),
        ("load", human_bytes(rates.get("load_bytes_per_s")) + "/s"),
        (
            "lookup latency",
            f"p50 {ms(latency['p50'])}  p95 {ms(latency['p95'])}  p99 {ms(latency['p99'])}",
        ),
        ("sessions", str(o["sessions"])),
        ("blocks", f"{o['blocks']} ({o['pinned_blocks']} pinned, {o['leases']} leases)"),
        (
            "per minute",
            f"evictions {_num(rates.get('evictions_per_min'), '{:.1f}')}  "
            f"demotions {_num(rates.get('demotions_per_min'), '{:.1f}')}  "
            f"expirations {_num(rates.get('expirations_per_min'), '{:.1f}')}",
        ),
        ("corrupt reads", str(counters["corrupt_reads"])),
    ]
    if o.get("miss_reasons"):
        for reason, tokens in o["miss_reasons"].items():
            figures.append((f"miss: {reason}", str(tokens)))
    tiers = [
        (
            t["name"],
            human_bytes(t["used_bytes"]),
            human_bytes(t["capacity_bytes"]),
            _num(
                _pct(t["used_bytes"] / t["capacity_bytes"] if t["capacity_bytes"] else None),
                "{:.1f} %",
            ),
            human_bytes(t["pinned_bytes"]),
            str(t["blocks"]),
            "up" if t["up"] else "DOWN",
        )
        for t in o["tiers"]
    ]
    parts = [
        f"sessioncache at {url}  ({time.strftime('%Y-%m-%d %H:%M:%S')})",
        "",
        table([(k, v) for k, v in figures]),
        "",
        table(tiers, ("tier", "used", "capacity", "full", "pinned", "blocks", "state")),
    ]
    fleet = o.get("fleet")
    if fleet:
        nodes = [
            (
                n["node_id"] + (" *" if n["self"] else ""),
                n.get("url") or "-",
                "healthy" if n["healthy"] else "lapsed",
            )
            for n in fleet["nodes"]
        ]
        parts += ["", table(nodes, ("node", "url", "health"))]
    problems = o.get("problems") or []
    parts += ["", "problems: " + ("; ".join(problems) if problems else "none (ready)")]
    return "\n".join(parts)


def _pct(value: float | None) -> float | None:
    return None if value is None else 100 * value


def fetch(url: str, token: str | None, timeout_s: float = 10.0) -> dict[str, Any]:
    import httpx

    headers = {"authorization": f"Bearer {token}"} if token else {}
    r = httpx.get(f"{url.rstrip('/')}/admin/api/overview", headers=headers, timeout=timeout_s)
    if r.status_code != 200:
        try:
            detail = r.json().get("detail", r.text)
        except ValueError:
            detail = r.text
        raise StatsError(f"{r.status_code}: {detail}")
    body: dict[str, Any] = r.json()
    return body


class StatsError(Exception):
    """The service refused or could not be reached."""


def run(args: argparse.Namespace) -> int:
    import httpx

    token = args.token or os.environ.get("SESSIONCACHE_ADMIN_TOKEN") or None
    url: str = args.url
    while True:
        try:
            text = render(fetch(url, token), url)
        except (StatsError, httpx.HTTPError) as exc:
            print(f"sessioncache stats: {url}: {exc}", file=sys.stderr)
            if not args.watch:
                return 2
            text = None
        if text is not None:
            if args.watch and sys.stdout.isatty():
                sys.stdout.write("\x1b[H\x1b[2J")  # home and clear: redraw in place
            print(text, flush=True)
        if not args.watch:
            return 0
        try:
            time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0


def register(sub: Any) -> None:
    parser = sub.add_parser("stats", help="print the dashboard's overview (a table)")
    parser.add_argument("--url", default=DEFAULT_URL, help=f"the service (default {DEFAULT_URL})")
    parser.add_argument(
        "--token", default=None, help="admin token (default: $SESSIONCACHE_ADMIN_TOKEN)"
    )
    parser.add_argument("--watch", action="store_true", help="redraw until Ctrl-C")
    parser.add_argument(
        "--interval", type=float, default=2.0, help="seconds between redraws (default 2)"
    )
    parser.set_defaults(func=run)
