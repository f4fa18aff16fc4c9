"""A private PostgreSQL server a test starts, stops and starts again (its own cluster in a
temporary folder, on a free port, fsync off). PostgreSQL refuses to run as root: as root the
cluster belongs to the ``postgres`` user and its commands run as that user."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.support.servers import free_port


def _bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if found:
        return Path(found[-1]).parent
    pg_ctl = shutil.which("pg_ctl")
    return Path(pg_ctl).parent if pg_ctl else None


class PrivatePostgres:
    """``start()``, ``stop()``, ``start()`` again, ``remove()``; ``url``: its database
    ``postgres`` as user ``postgres`` (trust auth)."""

    def __init__(self) -> None:
        bin_dir = _bin_dir()
        if bin_dir is None:
            pytest.skip("no PostgreSQL binaries (initdb, pg_ctl) on this machine")
        self._bin = bin_dir
        self._user: str | None = None
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                pytest.skip("PostgreSQL will not run as root and there is no user postgres")
            self._user = "postgres"
        self.root = Path(tempfile.mkdtemp(prefix="sc-private-pg-"))
        if self._user is not None:
            shutil.chown(self.root, self._user)
        self.port = free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self._run(
            "initdb",
            "-D",
            str(self.root / "data"),
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
            "--no-instructions",
        )

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self._bin / tool), *args]
        if self._user is not None:
            command = ["runuser", "-u", self._user, "--", *command]
        done = subprocess.run(command, capture_output=True, check=False, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed: {done.stdout!r} {done.stderr!r}")

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c full_page_writes=off -c synchronous_commit=off"
        )
        self._run(
            "pg_ctl",
            "-D",
            str(self.root / "data"),
            "-o",
            options,
            "-l",
            str(self.log),
            "-w",
            "start",
        )

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.root / "data"), "-m", "fast", "-w", "stop")

    @property
    def log(self) -> Path:
        return self.root / "postgres.log"

    def remove(self) -> None:
        if (self.root / "data" / "postmaster.pid").exists():
            with contextlib.suppress(RuntimeError):
                self._run("pg_ctl", "-D", str(self.root / "data"), "-m", "immediate", "stop")
        shutil.rmtree(self.root, ignore_errors=True)
