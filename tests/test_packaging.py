"""The wheel installs one top-level package: ``sessioncache`` (tiers, api and migrations
inside it), so that ``pip install sessioncache`` cannot collide with another ``api``."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def site_packages(env: Path) -> Path:
    return next((env / "lib").glob("python3*/site-packages"))


def test_the_wheel_installs_only_sessioncache_at_the_top_level(tmp_path: Path):
    dist = tmp_path / "dist"
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps"]
    # The fresh venv must not see the source tree (an egg-info there reads as installed).
    env_vars = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([*build, "-w", str(dist), str(ROOT)], check=True, timeout=300, env=env_vars)
    (wheel,) = dist.glob("sessioncache-*.whl")
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    before = {p.name for p in site_packages(env).iterdir()}
    pip = [str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    subprocess.run([*pip, str(wheel)], check=True, timeout=300, env=env_vars, cwd=tmp_path)
    added = {p.name for p in site_packages(env).iterdir()} - before
    assert {name for name in added if not name.endswith(".dist-info")} == {"sessioncache"}
    package = site_packages(env) / "sessioncache"
    for sub in ("tiers/disk.py", "api/app.py", "migrations/env.py", "migrations/versions"):
        assert (package / sub).exists(), sub
    assert not (package / "tiers").is_symlink()
    # the dashboard's files ship in the package: no CDN, no build step
    static = package / "api" / "admin" / "static"
    for name in (
        "admin.html",
        "admin.js",
        "admin.css",
        "uPlot.iife.min.js",
        "uPlot.min.css",
        "uPlot.LICENSE",
    ):
        assert (static / name).stat().st_size > 0, name


def test_nothing_imports_the_folders_by_their_old_top_level_names():
    """``tiers``/``api``/``migrations`` imported as top-level modules would load a second copy
    of each module beside ``sessioncache.tiers`` etc."""
    import re

    old = re.compile(r"^\s*(from|import)\s+(tiers|api|migrations)\b", re.MULTILINE)
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("sessioncache", "tiers", "api", "migrations", "tests", "bench", "examples")
        for path in (ROOT / folder).rglob("*.py")
        if old.search(path.read_text())
    ]
    assert offenders == []
