"""``sessioncache info``: open the configured tiers and print what they hold."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any


def run(args: argparse.Namespace) -> int:
    from sessioncache import __version__
    from sessioncache.config import Settings
    from sessioncache.factory import build_store

    settings = Settings()
    store = build_store(settings)
    try:
        stats = store.stats()
        print(
            json.dumps(
                {
                    "version": __version__,
                    "data_dir": str(settings.data_dir),
                    "blocks": stats.blocks,
                    "tiers": [asdict(t) for t in stats.tiers],
                },
                indent=2,
            )
        )
    finally:
        store.close()
    return 0


def register(sub: Any) -> None:
    parser = sub.add_parser("info", help="open the configured tiers and print what they hold")
    parser.set_defaults(func=run)
