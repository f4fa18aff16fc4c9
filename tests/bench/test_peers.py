"""``bench.peers``: a system that cannot run is a row saying why, and its sharing table runs on
tiny sizes (``slow``: a node started twice and reader processes). Figures are not checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import peers

ROOT = Path(__file__).parents[2]


def test_a_system_that_fails_is_a_row_saying_why() -> None:
    rows: list[peers.Row] = []

    def broken() -> list[peers.Row]:
        raise RuntimeError("lmcache bench l2 failed:\nTraceback ...\nImportError: no lmcache")

    peers.attempt(rows, "lmcache bench l2", 64, "fresh", broken)
    assert [(r.system, r.missing) for r in rows] == [
        ("lmcache bench l2", "failed: ImportError: no lmcache")
    ]
    assert peers.fmt(rows[0]).endswith("failed: ImportError: no lmcache")


def test_without_vllms_environment_its_rows_say_so(tmp_path: Path) -> None:
    assert peers.vllm_python(str(tmp_path / "absent" / "python")) is None
    (row,) = peers.vllm_rows(None, tmp_path, 64, "fresh", 2, 1)
    assert row.missing == "no vLLM environment"
    share = peers.vllm_sharing(None, tmp_path, 2, 64)
    assert share.second_process is None
    assert share.notes == ["not run: no vLLM environment"]


def test_rows_from_round_times() -> None:
    row = peers.timed_row("memcpy", 256, "warm", 2_000_000, [0.004, 0.002], [0.001, 0.003])
    assert (row.store, row.load) == pytest.approx((1.0, 2.0))
    assert (row.store_p50, row.store_p99) == pytest.approx((2.0, 4.0))
    assert (row.load_p50, row.load_p99) == pytest.approx((1.0, 3.0))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sharing_and_references_on_tiny_sizes() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [
            *(sys.executable, "-m", "bench.peers", "--systems", "sessioncache", "references"),
            *("--keys", "2", "--sizes-kb", "64", "--rounds", "1", "--regimes", "fresh"),
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    systems = [r["system"] for r in got["rows"]]
    assert systems == [
        "sessioncache same_host",
        "sessioncache stream",
        "memcpy",
        "dd fdatasync",
        "loopback socket",
    ]
    assert all(r["store"] > 0 and r["load"] > 0 and not r["missing"] for r in got["rows"])
    (node,) = got["sharing"]
    assert (node["second_process"], node["after_restart"], node["other_tenant"]) == (2, 2, 0)
