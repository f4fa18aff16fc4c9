"""The real ``sessioncache`` command line, run as a subprocess (``python -m sessioncache.cli``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """Run ``sessioncache ARGS`` to completion (killed after ``timeout_s``)."""
    return subprocess.run(
        [sys.executable, "-m", "sessioncache.cli", *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def run_cli_json(*args: str, env: dict[str, str] | None = None) -> Any:
    """Run ``sessioncache ARGS``, check that it succeeded, and parse what it printed."""
    done = run_cli(*args, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
