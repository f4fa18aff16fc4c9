"""The parallel run (README's test command runs two workers, pytest-xdist's ``-n 2``): some
tests must stay on one worker, one after the other:

* ``engines``: real vLLM engines, each of which takes every core it is given;
* ``hosts``: the fleet's network-namespace hosts, one network with fixed names.

``Groups`` schedules each group as one unit of work and every other test alone (xdist's own
``--dist loadgroup`` marks tests by rewriting their ids, which pytest 9 no longer reads). The
groups are collected first: the longest unit (the engines', minutes) then starts at once,
while the other worker takes the many short tests, rather than last, alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

GROUPS = {"vllm": "engines", "fleet": "hosts"}
TESTS = Path(__file__).parent


def group_of(path: str) -> str | None:
    """The group of a test by its path under ``tests/`` (None: a test on its own)."""
    parts = path.split("/")
    return GROUPS.get(parts[1]) if len(parts) > 2 and parts[0] == "tests" else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = [i for i in items if group_of(i.nodeid) is not None]
    items[:] = first + [i for i in items if group_of(i.nodeid) is None]


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "load":
        return None  # another --dist asked for: xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid) or nodeid

    return Groups(config, log)
