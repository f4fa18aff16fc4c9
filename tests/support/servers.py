"""Real ``sessioncache serve`` processes for tests that talk HTTP to the service."""

from __future__ import annotations

import os
import random
import resource
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

_EPHEMERAL = tuple(
    int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
)
_handed: set[int] = set()


def free_port() -> int:
    """A port no socket holds now, from below the kernel's ephemeral range: a port the kernel
    picked (bind to 0) is also the next one it may give an outgoing connection, and the
    parallel suite's other worker makes thousands of those (a replay socket once lost its
    port to one between this call and its bind). Random per call, never the same twice in
    one process."""
    rng = random.SystemRandom()
    high = min(_EPHEMERAL[0], 65536)
    while True:
        port = rng.randrange(max(1024, high - 22_000), high)
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.add(port)
        return port


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


def spawn_server(
    data_dir: Path, env: dict[str, str] | None = None, port: int = 0, *, nofile: int | None = None
) -> Server:
    """Start a server process without waiting for it to answer; ``nofile``: its descriptor
    limit (soft and hard)."""
    port = port or free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir.parent / f"serve-{port}.log"
    full_env = {
        **os.environ,
        "SESSIONCACHE_CPU_BYTES": str(64 << 20),
        "SESSIONCACHE_DISK_BYTES": str(256 << 20),
        "SESSIONCACHE_MAX_BODY_BYTES": str(8 << 20),
        # a free port per server (GET /v1/dataplane says which), never the fixed default
        "SESSIONCACHE_STREAM_PORT": "0",
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
        preexec_fn=None if nofile is None else lambda: _limit_fds(nofile),
    )
    return Server(f"http://127.0.0.1:{port}", port, process, data_dir, log)


def _limit_fds(n: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


def wait_ready(server: Server, timeout_s: float = 90.0) -> Server:
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


def wait_adopted(server: Server, timeout_s: float = 60.0) -> None:
    """Wait until a restarted node is strictly ready: its background pass has adopted the
    disk files whose catalog rows were still queued when it died (it serves the catalog's
    blocks at once, those after the pass)."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = httpx.get(f"{server.url}/readyz", params={"strict": "true"}, timeout=10)
        if reply.status_code == 200:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not ready after {timeout_s} s: {reply.text}")
        time.sleep(0.1)


DURABLE_NODE = {"SESSIONCACHE_DURABLE_UPLOADS": "true"}
"""A node that makes every store durable (answered once on disk), as crash tests want."""


def start_server(
    data_dir: Path, env: dict[str, str] | None = None, *, nofile: int | None = None
) -> Server:
    return wait_ready(spawn_server(data_dir, env, nofile=nofile))


def stop_group(process: subprocess.Popen[Any]) -> None:
    """Stop a process started with ``start_new_session=True`` and everything it started:
    SIGTERM to its group, SIGKILL after 30 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
