"""Clients killed with ``kill -9`` in the middle of a load and of a store: the node notices
the connection drop, releases the connection's leases, publishes no half-received block, and
goes on serving. Then the node itself is killed and restarted: every block whose STORE was
acknowledged is still there, byte for byte."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.sessioncache.dataplane.conftest import (
    BLOCK,
    NS,
    connect,
    pattern,
    rest,
    settled,
    tokens,
    wait_until,
)
from tests.support.servers import DURABLE_NODE, Server, start_server

ROOT_DIR = Path(__file__).parents[3]
SCRIPT = Path(__file__).with_name("killed_client.py")


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


def store_chain(server: Server, seed: int, blocks: int) -> list[bytes]:
    with connect(server) as client:
        root = client.resolve(NS)
        toks = tokens(seed, blocks)
        ids = client.block_hashes(root, toks)
        assert client.store(root, toks, [pattern(h) for h in ids]).stored == blocks
    return ids


def test_client_killed_mid_load(open_server: Server):
    # 256 blocks of 64 KiB: far more than the socket buffers hold, so the node is stuck
    # sending when the client dies
    store_chain(open_server, 10, 256)
    child = stalled_client("load", rest(open_server, "/v1/dataplane")["stream"], 10, 256)
    try:
        assert rest(open_server, "/v1/stats")["leases"] == 1
        assert rest(open_server, "/v1/dataplane")["connections"] == 1
    finally:
        kill_9(child)
    wait_until(lambda: settled(open_server))
    with connect(open_server) as client:  # still serving
        root = client.resolve(NS)
        assert client.lookup(root, client.block_hashes(root, tokens(10, 256))).matched == 256


def test_client_killed_mid_store(open_server: Server):
    store_chain(open_server, 20, 4)  # the chain the client leases before it stores
    address = rest(open_server, "/v1/dataplane")["stream"]
    child = stalled_client("store", address, 21, 10, 20, 4, 6)
    with connect(open_server) as client:
        root = client.resolve(NS)
        ids = client.block_hashes(root, tokens(21, 10))
        try:
            # the whole payloads sent are published as they arrive
            wait_until(lambda: client.lookup(root, ids).matched == 6)
            assert rest(open_server, "/v1/stats")["leases"] == 1
        finally:
            kill_9(child)
        # the killed connection is gone with its lease; this test's own connection remains
        wait_until(
            lambda: (
                rest(open_server, "/v1/stats")["leases"] == 0
                and rest(open_server, "/v1/dataplane")["connections"] == 1
            )
        )
        found = client.lookup(root, ids, lease_ms=10_000)
        assert found.matched == 6  # the half-sent block 6 was never published
        out = [np.empty(BLOCK, np.uint8) for _ in range(6)]
        client.load_into(found, out, release=True)
        assert all(np.array_equal(o, pattern(h)) for o, h in zip(out, ids, strict=False))
        assert client.load([ids[6]]) == [None]
    wait_until(lambda: settled(open_server))


def test_node_killed_and_restarted_keeps_acknowledged_blocks(tmp_path: Path):
    data = tmp_path / "data"
    server = start_server(data, DURABLE_NODE)
    try:
        with connect(server) as client:
            root = client.resolve(NS)
            toks = tokens(30, 40)
            ids = client.block_hashes(root, toks)
            ack = client.store(root, toks, [pattern(h) for h in ids])
            assert ack.stored == 40 and ack.durable
    finally:
        server.process.send_signal(signal.SIGKILL)
        assert server.process.wait(10) == -signal.SIGKILL
    server = start_server(data, DURABLE_NODE)
    try:
        with connect(server) as client:  # a new stream port: found again through REST
            root = client.resolve(NS)
            found = client.lookup(root, ids, lease_ms=10_000)
            assert found.matched == 40
            out = np.zeros((40, BLOCK), np.uint8)
            client.load_into(found, list(out), release=True)
            for h, row in zip(ids, out, strict=True):
                assert np.array_equal(row, pattern(h))
    finally:
        server.stop()
