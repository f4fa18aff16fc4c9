"""The prepared device check's dry run (``bench/gpu_check.sh --cpu``): every section runs on
the CPU, on tiny sizes, and the report says so. Not marked ``slow``: CI runs it, so that the
script a GPU machine's short lease depends on is known to work before it gets there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

pytestmark = pytest.mark.timeout(300)


def test_the_device_check_dry_run_reports_every_section(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(
        # the suite runs tests/gpu itself: the dry run's tests section runs one file of it
        [str(ROOT / "bench" / "gpu_check.sh"), "--cpu", "--tests", "tests/gpu/test_tiers.py"],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] is True and report["device"] == "cpu"
    for section in ("tests", "gpu_tier", "host_to_device", "ttft", "vllm"):
        assert "error" not in report[section], report[section]
    assert report["tests"]["passed"] and report["tests"]["failures"] == 0
    assert report["tests"]["tests"] >= 3
    assert report["gpu_tier"]["get_and_copy_gbps"] > 0
    assert report["host_to_device"]["stored"] == report["host_to_device"]["blocks"]
    for prefix in report["ttft"]["prefixes"].values():
        assert prefix["cached_tokens"] > 0 and prefix["logits_equal_within_bf16"]
    assert set(report["targets"]) == {
        "h2d_from_shared_tier_vs_pinned_ge_0.8",
        "gpu_tier_get_vs_d2d_ge_0.5",
        "ttft_longest_prefix_speedup_ge_10x",
        "ttft_logits_within_bf16",
    }
