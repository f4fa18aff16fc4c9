"""The ``sessioncache`` command line: one subcommand per module of ``sessioncache.commands``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from sessioncache import __version__

COMMANDS = ["info", "serve", "db", "gc", "replay", "stats"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sessioncache", description="Prefix-caching KV-cache service for LLM engines."
    )
    parser.add_argument("--version", action="version", version=f"sessioncache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"sessioncache.commands.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
