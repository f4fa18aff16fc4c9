"""Real Redis servers for tests: a standalone ``redis-server`` the test owns (to kill and
restart it) and a 3-master Redis Cluster built from ``redis-server`` processes with
``redis-cli --cluster create``. Everything listens on 127.0.0.1, keeps nothing on disk but
its tmp dir, and is stopped by pid.

Test modules import this file by path (tests are not a package)::

    spec = importlib.util.spec_from_file_location("redis_support", SUPPORT / "redis_cluster.py")
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

REDIS_SERVER = shutil.which("redis-server") or "redis-server"
REDIS_CLI = shutil.which("redis-cli") or "redis-cli"


def free_port(*, with_bus: bool = False) -> int:
    """A free TCP port on 127.0.0.1 (and, ``with_bus``, port + 10000 free too: the cluster bus)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not with_bus:
            return port
        if port + 10000 < 65536 and _is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair found")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_for(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if predicate():  # type: ignore[operator]
                return
        time.sleep(0.02)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1:``port``, started and stopped by this object."""

    def __init__(
        self, workdir: Path, port: int | None = None, *, extra: list[str] | None = None
    ) -> None:
        self.port = port if port is not None else free_port()
        self.workdir = workdir
        self.extra = list(extra or [])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout_s: float = 5.0) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            REDIS_SERVER,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            str(self.workdir),
            "--logfile",
            str(self.workdir / f"redis-{self.port}.log"),
            *self.extra,
        ]
        self.proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2)
        try:
            wait_for(lambda: client.ping(), timeout_s, f"redis-server on port {self.port}")
        finally:
            client.close()
        return self

    def stop(self, *, hard: bool = True) -> None:
        """Kill the process by pid (SIGKILL when ``hard``, else SIGTERM) and reap it."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        if hard:
            proc.kill()
        else:
            proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def restart(self, timeout_s: float = 5.0) -> RedisServer:
        self.stop()
        return self.start(timeout_s)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port)


class RedisClusterProcs:
    """A Redis Cluster of ``masters`` primaries (no replicas) from ``redis-server`` processes."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.workdir = workdir
        self.servers: list[RedisServer] = []
        for _ in range(masters):
            port = free_port(with_bus=True)
            while any(s.port == port for s in self.servers):
                port = free_port(with_bus=True)
            node_dir = workdir / f"node-{port}"
            self.servers.append(
                RedisServer(
                    node_dir,
                    port,
                    extra=[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(node_dir / "nodes.conf"),
                        "--cluster-node-timeout",
                        "2000",
                    ],
                )
            )

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]

    @property
    def pids(self) -> list[int]:
        return [s.pid for s in self.servers if s.pid is not None]

    @property
    def url(self) -> str:
        """A seed URL for ``sessioncache.redis_link.make_client``."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def start(self, timeout_s: float = 15.0) -> RedisClusterProcs:
        try:
            for server in self.servers:
                server.start()
            subprocess.run(
                [
                    REDIS_CLI,
                    "--cluster",
                    "create",
                    *[f"127.0.0.1:{p}" for p in self.ports],
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                check=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=timeout_s,
            )
            wait_for(self._ready, timeout_s, "cluster_state:ok on every node")
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        for port in self.ports:
            client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2)
            try:
                info = client.cluster("INFO")
                if isinstance(info, dict):
                    state = info.get("cluster_state")
                else:
                    text = info.decode() if isinstance(info, bytes) else str(info)
                    state = "ok" if "cluster_state:ok" in text else text
                if state != "ok":
                    return False
                slots = client.cluster("SLOTS")
                if sum(int(r[1]) - int(r[0]) + 1 for r in slots) != 16384:
                    return False
            finally:
                client.close()
        return True

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
