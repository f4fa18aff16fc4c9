"""``kill -9`` a node users start (write-behind on) in the middle of stores, durable ones and
not: every block acknowledged durable is there after the restart; of the others, at most the
write-behind bound is lost; nothing present is torn; the disk tier's files and what the
restarted node holds on disk agree."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np

from sessioncache.connector import StreamClient
from sessioncache.hashing import Namespace
from tests.support.servers import Server, start_server, wait_adopted

NS = Namespace("crash-behind", 16, "u8", "x")
BLOCK = 256 * 1024
BOUND = 8 << 20


def payload(h: bytes) -> np.ndarray:
    return np.frombuffer((bytes(h) * (BLOCK // 16))[:BLOCK], np.uint8)


def kill_9(server: Server) -> None:
    server.process.send_signal(signal.SIGKILL)
    assert server.process.wait(10) == -signal.SIGKILL


def test_kill_9_loses_no_durable_store_and_at_most_the_backlog_of_the_others(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    env = {"SESSIONCACHE_WRITE_BEHIND_BYTES": str(BOUND)}
    server = start_server(data, env)
    durable: list[bytes] = []
    behind: list[bytes] = []
    try:
        with StreamClient.discover(server.url, timeout=30) as client:
            root = client.resolve(NS)
            for i in range(40):
                tokens = [i * 1000 + t for t in range(4 * NS.block_tokens)]
                ids = client.block_hashes(root, tokens)
                ack = client.store(root, tokens, [payload(h) for h in ids], durable=i % 3 == 0)
                assert ack.kept == 4
                assert ack.durable == (i % 3 == 0)
                (durable if ack.durable else behind).extend(ids)
    finally:
        kill_9(server)
    server = start_server(data, env)
    try:
        wait_adopted(server)
        with StreamClient.discover(server.url, timeout=30) as client:
            root = client.resolve(NS)
            held = client.exists(root, durable + behind, counted=False)
            kept_durable = held[: len(durable)]
            assert all(kept_durable), f"{kept_durable.count(False)} durable blocks lost"
            lost = held[len(durable) :].count(False)
            assert lost * BLOCK <= BOUND, f"{lost} write-behind blocks lost"
            present = [h for h, ok in zip(durable + behind, held, strict=True) if ok]
            out = [np.empty(BLOCK, np.uint8) for _ in present]
            assert client.load_into(present, out, each=True) == [True] * len(present)
            for h, got in zip(present, out, strict=True):
                assert bytes(got) == bytes(payload(h)), f"block {h.hex()} is torn"
        blocks = data / "blocks"
        files = list(blocks.rglob("*.blk"))
        print(f"durable {len(durable)}, behind {len(behind)}, lost {lost}, files {len(files)}")
        assert len(files) == len(present)  # what the node holds is what the disk holds
        assert not list(blocks.rglob("*.tmp"))  # nothing half written
    finally:
        server.stop()
