"""Schemathesis over the node's own ``/openapi.json``, every check, with and without auth.

A real ``sessioncache serve`` per run; the CLI (``schemathesis run --checks all``) with its
coverage phase (boundary values, unsupported methods, missing auth) and fuzzing phase.
Failing means one of: a 5xx, a reply the description does not allow, a request it allows that
the server rejects, a wrong ``Allow`` on a 405, an operation that ignores auth.

``SESSIONCACHE_SCHEMATHESIS_EXAMPLES`` raises the examples per operation and phase (CI: 25,
about 1,300 cases over the two runs, side by side, in about a minute and a half).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.api.conftest import KEYS
from tests.support.servers import Server

EXAMPLES = int(os.environ.get("SESSIONCACHE_SCHEMATHESIS_EXAMPLES", "25"))
SEED = 20261130
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")


def start_schemathesis(server: Server, workdir: Path, *headers: str) -> subprocess.Popen[str]:
    """Start the CLI against ``server`` (the two runs go side by side: half the wall time)."""
    argv = [
        str(SCHEMATHESIS),
        "run",
        f"{server.url}/openapi.json",
        "--checks",
        "all",
        "--phases",
        "examples,coverage,fuzzing",
        "--max-examples",
        str(EXAMPLES),
        "--seed",
        str(SEED),
        "--wait-for-schema",
        "30",
    ]
    for header in headers:
        argv += ["-H", header]
    return subprocess.Popen(
        argv, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish(run: subprocess.Popen[str]) -> int:
    """Wait for a run; assert it passed; the number of cases it generated."""
    try:
        report, _ = run.communicate(timeout=170)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 0, report[-20000:]
    generated = re.search(r"(\d+) generated", report)
    assert generated, report[-5000:]
    return int(generated.group(1))


@pytest.mark.timeout(400)
def test_schemathesis_finds_nothing(
    open_server: Server, auth_server: Server, tmp_path: Path
) -> None:
    key = next(iter(KEYS))
    (tmp_path / "open").mkdir()
    (tmp_path / "auth").mkdir()
    runs = [
        start_schemathesis(open_server, tmp_path / "open"),
        start_schemathesis(auth_server, tmp_path / "auth", f"Authorization: Bearer {key}"),
    ]
    cases = sum(finish(run) for run in runs)
    print(f"schemathesis: {cases} cases generated")
    assert cases >= 1000, cases
