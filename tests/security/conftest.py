"""A real node with two tenants (alice and bob; alice trusted on the same-host socket), and a
guard that kills it past a memory limit rather than let an attack take the machine."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.support.servers import Server, start_server

KEYS = {"key-alice": "alice", "key-bob": "bob"}
ALICE = {"authorization": "Bearer key-alice"}
BOB = {"authorization": "Bearer key-bob"}
METRICS_TOKEN = "metrics-token-of-the-operator"
METRICS = {"authorization": f"Bearer {METRICS_TOKEN}"}
"""What a scrape of every tenant's series carries (a tenant's key gets the node-wide ones)."""


def rss_bytes(pid: int) -> int:
    """The resident set of a process (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


@dataclass
class Guarded:
    """A node under a memory guard: ``peak`` is the largest RSS seen; past ``limit`` the guard
    kills the node (``killed`` then says so)."""

    server: Server
    limit: int
    peak: int = 0
    killed: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return self.server.url

    def rss(self) -> int:
        return rss_bytes(self.server.process.pid)

    def settled_rss(self, timeout_s: float = 10.0) -> int:
        """The RSS once it stops moving (background work, such as spare chunks being
        faulted in, done): two readings 0.3 s apart within 1 MiB."""
        deadline = time.monotonic() + timeout_s
        last = self.rss()
        while time.monotonic() < deadline:
            time.sleep(0.3)
            now = self.rss()
            if abs(now - last) < 1 << 20:
                return now
            last = now
        return last

    def watch(self) -> None:
        while not self._stop.wait(0.05):
            rss = self.rss()
            self.peak = max(self.peak, rss)
            if rss > self.limit:
                self.killed = True
                self.server.process.kill()
                return

    def stop(self) -> None:
        self._stop.set()
        self.server.stop()


NodeFactory = Callable[..., Guarded]


@pytest.fixture
def guarded_node(tmp_path: Path) -> Iterator[NodeFactory]:
    """``guarded_node(env, limit=...)``: a node with alice's and bob's keys, the metrics token
    and ``env`` on top, killed if its RSS passes ``limit`` (default 1.5 GiB)."""
    started: list[Guarded] = []

    def start(
        env: dict[str, str] | None = None,
        *,
        limit: int = 3 << 29,
        nofile: int | None = None,
        data_dir: Path | None = None,
    ) -> Guarded:
        full = {
            "SESSIONCACHE_API_KEYS": json.dumps(KEYS),
            "SESSIONCACHE_SHM_TRUSTED_TENANTS": json.dumps(["alice"]),
            "SESSIONCACHE_METRICS_TOKEN": METRICS_TOKEN,
            **(env or {}),
        }
        where = data_dir or tmp_path / f"node{len(started)}" / "data"
        node = Guarded(start_server(where, full, nofile=nofile), limit)
        started.append(node)
        threading.Thread(target=node.watch, daemon=True).start()
        return node

    yield start
    for node in started:
        node.stop()


def wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def client(node: Guarded, headers: dict[str, str], timeout: float = 30) -> httpx.Client:
    return httpx.Client(base_url=node.url, headers=headers, timeout=timeout)
