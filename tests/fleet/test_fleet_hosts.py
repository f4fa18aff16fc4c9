"""docker-compose.yml's fleet on separate hosts: each host is a network namespace of its own,
all of them on one bridge, as hosts on one LAN. A services host runs a private Redis and a
private PostgreSQL on their usual ports; two node hosts run ``sessioncache serve`` with exactly
the environment compose gives node-a and node-b (its variables set to this network's
addresses); the test process is the engine host (the bridge's own address). A chain stored on
A over A's block stream loads byte-exact from B over B's stream; B's lookup names A as a holder,
and the fleet registry gives A's advertised URL, which the engine host reaches. A's link cut,
B still serves, from the shared tier, a chain it never read before, and stays ready."""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import psycopg
import pytest
import redis

from sessioncache.connector.transfer import KVTransfer
from sessioncache.hashing import Namespace
from tests.support.servers import Server, wait_ready
from tests.test_deployment import node_environment

PG_BIN = Path("/usr/local/bin")
PG_USER = "postgres"  # initdb refuses root: the private server runs as this system user
BLOCK_TOKENS = 16
BLOCK_BYTES = 8192
NS = Namespace("fleet-hosts", BLOCK_TOKENS, "bf16", "test")


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@dataclass
class Network:
    """Network namespaces on one bridge of the root namespace (whose address is the engine
    host's), everything named after one random tag."""

    tag: str
    subnet: str  # "10.x.y": hosts are .2, .3, ...; the bridge is .1
    hosts: dict[str, str] = field(default_factory=dict)  # name -> namespace
    links: dict[str, str] = field(default_factory=dict)  # name -> root end of its veth

    @property
    def bridge(self) -> str:
        return f"scb{self.tag}"

    def address(self, name: str) -> str:
        return f"{self.subnet}.{2 + list(self.hosts).index(name)}"

    def add_host(self, name: str) -> str:
        ns, link = f"sc{self.tag}-{name}", f"sc{self.tag}{len(self.hosts)}"
        ip("netns", "add", ns)
        self.hosts[name] = ns
        ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self.links[name] = link
        ip("link", "set", link, "master", self.bridge, "up")
        ip("-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
        return ns

    def cut(self, name: str) -> None:
        """Unplug host ``name`` from the LAN."""
        ip("link", "set", self.links[name], "down")

    def remove(self) -> None:
        """Delete every link, namespace and the bridge (a namespace's own end of a link would
        otherwise outlive it until the kernel's deferred cleanup)."""
        for link in self.links.values():
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=10)
        for ns in self.hosts.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=10)


def free_subnet() -> str:
    used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
    for _ in range(100):
        subnet = f"10.{secrets.randbelow(50) + 200}.{secrets.randbelow(256)}"
        if f" {subnet}." not in used:
            return subnet
    raise RuntimeError("no free 10.x.y.0/24 subnet")


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2)")
    net = Network(secrets.token_hex(3), free_subnet())
    probe = subprocess.run(
        ["ip", "link", "add", net.bridge, "type", "bridge"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        pytest.skip(f"creating network devices is not permitted here: {probe.stderr.strip()}")
    try:
        ip("addr", "add", f"{net.subnet}.1/24", "dev", net.bridge)
        ip("link", "set", net.bridge, "up")
        try:
            net.add_host("probe")
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"`ip netns` is not permitted here: {exc.stderr.decode().strip()}")
        yield net
    finally:
        net.remove()


def exec_in(ns: str, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def redis_answers(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5) as r:
            return bool(r.ping())
    except redis.RedisError:
        return False


@dataclass
class Services:
    redis_url: str
    database_url: str


@pytest.fixture(scope="module")
def services(network: Network) -> Iterator[Services]:
    """The services host: Redis and PostgreSQL as compose's redis and postgres services run
    them (no persistence; trust auth, user and database `sessioncache`), on their ports."""
    if shutil.which("redis-server") is None or not (PG_BIN / "initdb").exists():
        pytest.skip("needs redis-server and PostgreSQL's initdb/pg_ctl")
    try:
        pwd.getpwnam(PG_USER)
    except KeyError:
        pytest.skip(f"no user {PG_USER!r} to run a private PostgreSQL as (initdb refuses root)")
    ns = network.add_host("services")
    host = network.address("services")
    cleanup: list[Callable[[], Any]] = []
    try:
        redis_proc = subprocess.Popen(
            exec_in(
                ns,
                [
                    "redis-server",
                    *("--port", "6379", "--bind", host, "--protected-mode", "no"),
                    *("--save", "", "--appendonly", "no"),
                ],
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def stop_redis() -> None:
            redis_proc.kill()
            redis_proc.wait(10)

        cleanup.append(stop_redis)
        # PostgreSQL's files live where its user can reach them (pytest's tmp is root's only).
        pg_dir = Path(tempfile.mkdtemp(prefix=f"sc{network.tag}-pg-"))
        cleanup.append(lambda: shutil.rmtree(pg_dir, ignore_errors=True))
        shutil.chown(pg_dir, PG_USER)
        as_pg = ["runuser", "-u", PG_USER, "--"]
        data = pg_dir / "data"
        subprocess.run(
            [*as_pg, str(PG_BIN / "initdb"), "-D", str(data), "-U", "sessioncache", "-A", "trust"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        with (data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {network.subnet}.0/24 trust\n")
        options = f"-c listen_addresses={host} -c port=5432 -c fsync=off "
        options += f"-c unix_socket_directories={pg_dir}"
        pg_ctl = [*as_pg, str(PG_BIN / "pg_ctl"), "-D", str(data)]
        subprocess.run(
            exec_in(ns, [*pg_ctl, "-o", options, "-l", str(pg_dir / "log"), "-w", "start"]),
            check=True,
            capture_output=True,
            timeout=60,
        )
        cleanup.append(
            lambda: subprocess.run(
                [*pg_ctl, "-m", "immediate", "stop"],
                capture_output=True,
                timeout=30,
            )
        )
        with psycopg.connect(f"postgresql://sessioncache@{host}:5432/postgres") as conn:
            conn.autocommit = True
            conn.execute("CREATE DATABASE sessioncache")
        redis_url = f"redis://{host}:6379/0"
        wait_until(lambda: redis_answers(redis_url), "the services host's Redis")
        yield Services(redis_url, f"postgresql+psycopg://sessioncache@{host}:5432/sessioncache")
    finally:
        for undo in reversed(cleanup):
            undo()


def start_node(network: Network, services: Services, name: str, tmp: Path) -> Server:
    """``sessioncache serve`` on its own host with compose's environment for ``name``."""
    ns = network.add_host(name)
    host = network.address(name)
    env = node_environment(
        name,
        {
            "REDIS_URL": services.redis_url,
            "DATABASE_URL": services.database_url,
            f"NODE_{name[-1].upper()}_URL": f"http://{host}:8080",
            f"NODE_{name[-1].upper()}_STREAM": f"{host}:8081",
        },
    )
    # What a real host also sets for itself: where its disk tier lives and how much memory
    # and disk it gives the cache (compose's figures are a production host's).
    data_dir = tmp / name / "data"
    data_dir.mkdir(parents=True)
    env |= {
        "SESSIONCACHE_DATA_DIR": str(data_dir),
        "SESSIONCACHE_CPU_BYTES": str(32 << 20),
        "SESSIONCACHE_DISK_BYTES": str(128 << 20),
    }
    base = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONCACHE_")}
    log = tmp / f"{name}.log"
    process = subprocess.Popen(
        exec_in(ns, [sys.executable, "-m", "sessioncache.cli", "serve"]),
        env=base | env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    return Server(f"http://{host}:8080", 8080, process, data_dir, log)


def is_ready(node: Server) -> bool:
    """``/readyz`` says ready, not degraded."""
    reply = httpx.get(f"{node.url}/readyz", timeout=5)
    return reply.status_code == 200 and reply.json().get("status") == "ready"


def payloads(seed: int, n: int) -> list[npt.NDArray[np.uint8]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8) for _ in range(n)]


def prompt(seed: int, blocks: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, 50_000, blocks * BLOCK_TOKENS)]


def load(kv: KVTransfer, tokens: list[int], n: int) -> list[bytes]:
    out = [np.zeros(BLOCK_BYTES, dtype=np.uint8) for _ in range(n)]
    got = kv.load_into(tokens, out)
    return [o.tobytes() for o in out[: got.blocks]]


@dataclass
class Fleet:
    network: Network
    services: Services
    a: Server
    b: Server
    key: str

    @property
    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}

    def stream(self, node: Server) -> KVTransfer:
        """An engine's transfer with ``node``, over its block stream."""
        kv = KVTransfer.from_url(node.url, api_key=self.key, namespace=NS, path="stream")
        assert kv.path == "stream"
        return kv

    def lookup(self, node: Server, tokens: list[int]) -> dict[str, Any]:
        """An engine's lookup of a prompt (by its tokens) with the fleet's locations."""
        body = {"namespace": NS.as_json(), "tokens": tokens, "locations": True}
        reply = httpx.post(f"{node.url}/v1/lookup", json=body, headers=self.auth, timeout=10)
        assert reply.status_code == 200, reply.text
        data: dict[str, Any] = reply.json()
        return data


@pytest.fixture(scope="module")
def fleet(
    network: Network, services: Services, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    (key,) = json.loads(node_environment("node-a")["SESSIONCACHE_API_KEYS"])
    tmp = tmp_path_factory.mktemp("fleet-hosts")
    nodes = [start_node(network, services, name, tmp) for name in ("node-a", "node-b")]
    try:
        a, b = (wait_ready(n, timeout_s=60) for n in nodes)
        for name, node in (("node-a", a), ("node-b", b)):
            # ready, not degraded: the node reached Redis (its first probe may predate the link)
            wait_until(partial(is_ready, node), f"{name} reaching Redis", 15)
        yield Fleet(network, services, a, b, key)
    finally:
        for n in nodes:
            n.stop()


def test_each_node_advertises_its_own_host(fleet: Fleet) -> None:
    for name, node in (("node-a", fleet.a), ("node-b", fleet.b)):
        # engines are told the node's own host's stream address, never the one it binds
        plane = httpx.get(f"{node.url}/v1/dataplane", headers=fleet.auth, timeout=5).json()
        assert f"{fleet.network.address(name)}:8081" in json.dumps(plane), plane
    with redis.Redis.from_url(fleet.services.redis_url) as r:
        infos = [r.get(k) for k in r.scan_iter("sc:node:*")]
    urls = {json.loads(i)["url"] for i in infos if i}
    assert urls == {f"http://{fleet.network.address(n)}:8080" for n in ("node-a", "node-b")}
    for url in urls:  # what the fleet registry advertises, the engine host reaches
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200


def test_a_stream_load_alone_reaches_the_shared_tier(fleet: Fleet) -> None:
    tokens, blocks = prompt(3, 4), payloads(3, 4)
    with fleet.stream(fleet.a) as on_a:
        assert on_a.store_from(tokens, blocks).blocks == 4
    with fleet.stream(fleet.b) as on_b:
        assert load(on_b, tokens, 4) == [p.tobytes() for p in blocks]


def test_a_chain_stored_on_one_host_is_served_by_the_other_after_the_first_is_cut(
    fleet: Fleet,
) -> None:
    first, second = prompt(1, 6), prompt(2, 5)
    first_blocks, second_blocks = payloads(1, 6), payloads(2, 5)
    with fleet.stream(fleet.a) as on_a:
        assert on_a.store_from(first, first_blocks).blocks == 6
        assert on_a.store_from(second, second_blocks).blocks == 5

    with fleet.stream(fleet.b) as on_b:
        # B never saw the chain: its lookup finds it in the shared tier, and names A as a
        # holder once A's holdings are published (a background flush)
        def a_listed() -> bool:
            body = fleet.lookup(fleet.b, first)
            assert body["matched_blocks"] == 6, body
            return all("node-a" in loc for loc in body["locations"])

        wait_until(a_listed, "B's lookup to name node-a as a holder", 10)
        assert load(on_b, first, 6) == [p.tobytes() for p in first_blocks]

        fleet.network.cut("node-a")
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{fleet.a.url}/healthz", timeout=1)
        # B never read the second chain: it comes from the shared tier, A being gone
        found = fleet.lookup(fleet.b, second)
        assert found["matched_blocks"] == 5
        assert {blk["tier"] for blk in found["blocks"]} == {"redis"}
        assert load(on_b, second, 5) == [p.tobytes() for p in second_blocks]
        assert load(on_b, first, 6) == [p.tobytes() for p in first_blocks]
        ready = httpx.get(f"{fleet.b.url}/readyz", timeout=5)
        assert ready.status_code == 200, ready.text
        assert ready.json()["status"] == "ready", ready.text
