"""A real ``sessioncache serve`` process per test module, and httpx clients against it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

KEYS = {"key-acme": "acme", "key-globex": "globex"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    data_dir: Path
    log: Path

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def start_server(data_dir: Path, env: dict[str, str] | None = None) -> Server:
    port = free_port()
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    log = data_dir.parent / f"serve-{port}.log"
    full_env = {
        **os.environ,
        "SESSIONCACHE_CPU_BYTES": str(64 << 20),
        "SESSIONCACHE_DISK_BYTES": str(256 << 20),
        "SESSIONCACHE_MAX_BODY_BYTES": str(8 << 20),
        **(env or {}),
    }
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sessioncache.cli",
            "serve",
            "--port",
            str(port),
            "--data-dir",
            str(data_dir),
        ],
        env=full_env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    server = Server(f"http://127.0.0.1:{port}", process, data_dir, log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()}")
        try:
            if httpx.get(f"{server.url}/healthz", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"server did not start: {log.read_text()}")


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("open") / "data")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("auth") / "data",
        {"SESSIONCACHE_API_KEYS": json.dumps(KEYS)},
    )
    yield server
    server.stop()


@pytest.fixture
def client(open_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=open_server.url, timeout=30) as c:
        yield c
