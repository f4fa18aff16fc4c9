"""Groups for the parallel run (README's test command runs two workers, ``--dist loadgroup``):
the tests of one group run on one worker, one after the other.

* ``engines``: real vLLM engines, each of which takes every core it is given;
* ``hosts``: the fleet's network-namespace hosts, one network with fixed names.

The groups are collected first: the longest run of one worker (the engines', minutes) then
starts at once, while the other worker takes the many short tests, rather than last, alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

GROUPS = {"vllm": "engines", "fleet": "hosts"}
TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    grouped: list[pytest.Item] = []
    rest: list[pytest.Item] = []
    for item in items:
        parts = item.path.relative_to(TESTS).parts
        group = GROUPS.get(parts[0]) if len(parts) > 1 else None
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        (grouped if group is not None else rest).append(item)
    items[:] = grouped + rest
