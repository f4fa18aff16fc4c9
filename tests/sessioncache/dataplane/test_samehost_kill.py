"""Same-host clients killed with ``kill -9`` in the middle of a load and of a staged store:
the node releases the connection's leases and frees its staged slots, and publishes nothing
half written. Then the node itself is killed and restarted: no segment of its previous life
survives (memfd: nothing in ``/dev/shm``, nothing held by any process), and the blocks whose
store was acknowledged are intact, read back from the disk tier into fresh segments."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from sessioncache.connector.samehost import SameHostClient
from sessioncache.hashing import block_key
from tests.sessioncache.dataplane.conftest import BLOCK, NS, pattern, rest, tokens, wait_until
from tests.support.servers import DURABLE_NODE, Server, start_server

ROOT_DIR = Path(__file__).parents[3]
SCRIPT = Path(__file__).with_name("samehost_client.py")


def socket_path(server: Server) -> str:
    path = rest(server, "/v1/dataplane")["same_host"]
    assert isinstance(path, str)
    return path


def cpu_used(server: Server) -> int:
    tiers = rest(server, "/v1/stats")["tiers"]
    return int(next(t["used_bytes"] for t in tiers if t["name"] == "cpu"))


def settled(server: Server) -> bool:
    return (
        rest(server, "/v1/stats")["leases"] == 0
        and rest(server, "/v1/dataplane")["same_host_connections"] == 0
    )


def stalled_client(*args: object) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT_DIR)}
    child = subprocess.Popen(
        [sys.executable, str(SCRIPT), *map(str, args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    if line.strip() != "stalled":
        child.kill()
        raise AssertionError(f"the client did not stall: {line!r} {child.stderr.read()!r}")
    return child


def kill_9(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGKILL)
    assert process.wait(10) == -signal.SIGKILL


def memfds(pid: int) -> list[str]:
    """The sessioncache segments process ``pid`` holds open."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:sessioncache-"):
            found.append(target)
    return found


def test_client_killed_mid_load(open_server: Server):
    child = stalled_client("load", socket_path(open_server), 40, 16)
    try:
        assert rest(open_server, "/v1/stats")["leases"] == 1
        assert rest(open_server, "/v1/dataplane")["same_host_connections"] == 1
    finally:
        kill_9(child)
    wait_until(lambda: settled(open_server))
    with SameHostClient.connect(socket_path(open_server)) as client:  # still serving
        root = client.resolve(NS)
        ids = client.block_hashes(root, tokens(40, 16))
        found = client.locate(root, ids)
        out = np.zeros((16, BLOCK), np.uint8)
        client.load_into(found, list(out), verify=True)
        assert all(np.array_equal(row, pattern(h)) for row, h in zip(out, ids, strict=True))


def test_client_killed_mid_staged_store(open_server: Server):
    wait_until(lambda: settled(open_server))
    used = cpu_used(open_server)
    blocks = rest(open_server, "/v1/stats")["blocks"]
    child = stalled_client("stage", socket_path(open_server), 41, 12)
    try:
        assert cpu_used(open_server) == used + 12 * BLOCK  # the slots, reserved
        assert rest(open_server, "/v1/dataplane")["same_host_connections"] == 1
    finally:
        kill_9(child)
    wait_until(lambda: settled(open_server) and cpu_used(open_server) == used)
    assert rest(open_server, "/v1/stats")["blocks"] == blocks  # nothing published
    with SameHostClient.connect(socket_path(open_server)) as client:
        root = client.resolve(NS)
        toks = tokens(41, 12)
        ids = client.block_hashes(root, toks)
        assert client.locate(root, ids).matched == 0
        # the ids are free again: a new store of them goes through
        assert client.store(root, toks, [pattern(h) for h in ids]).stored == 12


def test_client_killed_between_commits_publishes_only_what_it_committed(open_server: Server):
    # a staging committed in two COMMITs: the first went through, the second half's slots
    # were being written (torn: half their bytes) when the client died
    wait_until(lambda: settled(open_server))
    used = cpu_used(open_server)
    blocks = rest(open_server, "/v1/stats")["blocks"]
    child = stalled_client("commit-half", socket_path(open_server), 42, 12)
    try:
        assert cpu_used(open_server) == used + 12 * BLOCK
        assert rest(open_server, "/v1/stats")["blocks"] == blocks + 6  # the committed half
    finally:
        kill_9(child)
    # the uncommitted slots are freed, the committed blocks stay published
    wait_until(lambda: settled(open_server) and cpu_used(open_server) == used + 6 * BLOCK)
    assert rest(open_server, "/v1/stats")["blocks"] == blocks + 6
    with SameHostClient.connect(socket_path(open_server)) as client:
        root = client.resolve(NS)
        toks = tokens(42, 12)
        ids = client.block_hashes(root, toks)
        found = client.locate(root, ids)
        assert found.matched == found.located == 6  # nothing of the torn half
        out = np.zeros((6, BLOCK), np.uint8)
        client.load_into(found, list(out), verify=True)
        assert all(np.array_equal(row, pattern(h)) for row, h in zip(out, ids[:6], strict=True))
        assert client.exists(root, ids) == [True] * 6 + [False] * 6
        ack = client.store(root, toks, [pattern(h) for h in ids])
        assert ack.tally("present") == 6 and ack.stored == 6


def test_keyed_client_killed_mid_staged_store(open_server: Server):
    wait_until(lambda: settled(open_server))
    used = cpu_used(open_server)
    blocks = rest(open_server, "/v1/stats")["blocks"]
    child = stalled_client("stage-keyed", socket_path(open_server), 43, 8)
    try:
        assert cpu_used(open_server) == used + 8 * BLOCK
    finally:
        kill_9(child)
    wait_until(lambda: settled(open_server) and cpu_used(open_server) == used)
    assert rest(open_server, "/v1/stats")["blocks"] == blocks
    with SameHostClient.connect(socket_path(open_server)) as client:
        root = client.resolve(NS)
        keys = [block_key(f"killed-43-{i}") for i in range(8)]
        ids = client.key_ids(root, keys)
        assert client.exists(root, ids) == [False] * 8
        assert client.locate(root, ids, keyed=True).matched == 0


def test_several_clients_killed_at_once(open_server: Server):
    # a load holding a lease, a staged store, a half-committed one and a keyed staging, all
    # mid-way when they die together: every lease and every uncommitted slot comes back
    wait_until(lambda: settled(open_server))
    used = cpu_used(open_server)
    children = [
        stalled_client("load", socket_path(open_server), 60, 8),
        stalled_client("stage", socket_path(open_server), 61, 8),
        stalled_client("commit-half", socket_path(open_server), 62, 8),
        stalled_client("stage-keyed", socket_path(open_server), 63, 8),
    ]
    try:
        assert rest(open_server, "/v1/stats")["leases"] == 1
        assert rest(open_server, "/v1/dataplane")["same_host_connections"] == 4
    finally:
        for child in children:
            child.send_signal(signal.SIGKILL)
        for child in children:
            assert child.wait(10) == -signal.SIGKILL
    # what stays: the loaded chain (stored before the lease) and the committed half
    wait_until(lambda: settled(open_server) and cpu_used(open_server) == used + 12 * BLOCK)
    with SameHostClient.connect(socket_path(open_server)) as client:
        root = client.resolve(NS)
        for seed, held in ((60, 8), (61, 0), (62, 4)):
            ids = client.block_hashes(root, tokens(seed, 8))
            assert client.exists(root, ids) == [True] * held + [False] * (8 - held), seed


def test_node_killed_and_restarted_leaves_no_segment_and_keeps_acknowledged_blocks(
    tmp_path: Path,
):
    data = tmp_path / "data"
    shm_before = set(os.listdir("/dev/shm"))
    server = start_server(data, DURABLE_NODE)
    try:
        with SameHostClient.connect(socket_path(server)) as client:
            root = client.resolve(NS)
            toks = tokens(50, 24)
            ids = client.block_hashes(root, toks)
            ack = client.store(root, toks, [pattern(h) for h in ids])
            assert ack.stored == 24 and ack.durable
        assert memfds(server.process.pid)  # the CPU tier's segments
        assert not memfds(os.getpid())  # the client closed: it maps nothing any more
    finally:
        old = server.process.pid
        server.process.send_signal(signal.SIGKILL)
        assert server.process.wait(10) == -signal.SIGKILL
    assert not os.path.exists(f"/proc/{old}")  # its descriptors, and so its segments, are gone
    # never named there in the first place (other programs may come and go there)
    assert not [n for n in set(os.listdir("/dev/shm")) - shm_before if "sessioncache" in n]

    server = start_server(data, DURABLE_NODE)
    try:
        # a fresh node: only the memory it makes ahead from start (CPU tier, staging spares)
        ahead = memfds(server.process.pid)
        assert all("sessioncache-cpu-" in m or "sessioncache-staging-" in m for m in ahead)
        with SameHostClient.connect(socket_path(server)) as client:
            root = client.resolve(NS)
            found = client.locate(root, ids)  # held on disk only: copied into shared memory
            assert found.located == 24
            out = np.zeros((24, BLOCK), np.uint8)
            client.load_into(found, list(out), verify=True)
            for h, row in zip(ids, out, strict=True):
                assert np.array_equal(row, pattern(h))
        assert memfds(server.process.pid)
        assert rest(server, "/v1/stats")["counters"]["promotions"] == 24
    finally:
        server.stop()
