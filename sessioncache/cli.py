"""The ``sessioncache`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from sessioncache import __version__
from sessioncache.config import Settings


def _cmd_info(args: argparse.Namespace) -> int:
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
                    "tiers": [
                        {
                            "name": t.name,
                            "capacity_bytes": t.capacity_bytes,
                            "used_bytes": t.used_bytes,
                            "blocks": t.blocks,
                            "durable": t.durable,
                        }
                        for t in stats.tiers
                    ],
                },
                indent=2,
            )
        )
    finally:
        store.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sessioncache", description=__doc__)
    parser.add_argument("--version", action="version", version=f"sessioncache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="open the configured tiers and print what they hold")
    info.set_defaults(func=_cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
