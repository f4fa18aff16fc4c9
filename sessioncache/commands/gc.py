"""``sessioncache gc``: one sweep by hand (expire sessions and blocks), printing what it freed.

Run it against a stopped service's data directory and catalog; a running service sweeps on
its own every ``SESSIONCACHE_SWEEP_INTERVAL_S`` (and ``POST /v1/gc`` sweeps it now).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any


def run(args: argparse.Namespace) -> int:
    from sessioncache.config import Settings
    from sessioncache.errors import CatalogError
    from sessioncache.factory import open_node

    overrides: dict[str, Any] = {}
    if args.data_dir is not None:
        overrides["data_dir"] = args.data_dir
    try:
        node = open_node(Settings(**overrides), start=False)
    except CatalogError as exc:  # not there, not migrated, read-only: the message names it
        print(f"cannot sweep: {exc}", file=sys.stderr)
        return 2
    try:
        before = {t.name: t.used_bytes for t in node.store.stats_tiers()}
        report = node.sessions.sweep()
        after = {t.name: t.used_bytes for t in node.store.stats_tiers()}
        freed = {name: before[name] - after[name] for name in before}
        print(json.dumps({**asdict(report), "freed_bytes": freed}, indent=2))
    finally:
        node.close()
    return 0


def register(sub: Any) -> None:
    parser = sub.add_parser("gc", help="run one sweep: expire sessions and blocks, print freed")
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.set_defaults(func=run)
