"""Real ``sessioncache serve`` processes for the connector tests (the same way as
tests/api/conftest.py, copied: tests are imported with importlib and are not a package)."""

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

from sessioncache.hashing import Namespace

API_KEYS = {"k": "t"}
NS = Namespace("connector-test-model", block_tokens=8, kv_dtype="float32", kv_layout="raw")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    data_dir: Path
    log: Path

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def spawn_server(data_dir: Path, env: dict[str, str] | None = None, port: int = 0) -> Server:
    """Start a server process without waiting for it to answer."""
    port = port or free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
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
    return Server(f"http://127.0.0.1:{port}", port, process, data_dir, log)


def wait_ready(server: Server, timeout_s: float = 30.0) -> Server:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited: {server.log.read_text()}")
        try:
            if httpx.get(f"{server.url}/healthz", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"server did not start: {server.log.read_text()}")


def start_server(data_dir: Path, env: dict[str, str] | None = None) -> Server:
    return wait_ready(spawn_server(data_dir, env))


@pytest.fixture(scope="session")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("connector-open") / "data")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("connector-auth") / "data",
        {"SESSIONCACHE_API_KEYS": json.dumps(API_KEYS)},
    )
    yield server
    server.stop()
