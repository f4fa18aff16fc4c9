"""kill -9 mid-traffic: every acknowledged block and session survives, byte for byte.

A child process stores session chains with ``durable=True`` through a ``SessionManager`` whose
store reports to the catalog (written behind by its flusher thread), printing each id after the
call returned; the parent kills it with SIGKILL, reopens everything the way the service starts
(disk tier, store, catalog, reconcile, restore) and checks what was acknowledged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from sessioncache.catalog.reconcile import CatalogRecoveredTier, reconcile
from sessioncache.hashing import BlockHash, Namespace
from sessioncache.sessions.manager import SessionManager
from sessioncache.store import TieredStore
from sessioncache.tiers.disk import DiskTier

NS = Namespace("test-model", 4, "float16", "test-layout")
ROOT = NS.root()
SIZE = 4096
CAPACITY = 1 << 28
ACKED_BLOCKS = 60

CHILD = r"""
import json, sys
import numpy as np
from sessioncache.catalog import Catalog
from sessioncache.hashing import Namespace, block_hashes
from sessioncache.sessions.manager import SessionManager
from sessioncache.store import TieredStore
from sessioncache.tiers.disk import DiskTier

cfg = json.loads(sys.argv[1])
ns = Namespace("test-model", 4, "float16", "test-layout")
root = ns.root()
catalog = Catalog.open(cfg["url"], schema=cfg["schema"], flush_interval_s=cfg["interval"])
catalog.start()
store = TieredStore(
    [DiskTier.open(cfg["root"], cfg["capacity"], fsync=False)], observers=[catalog]
)
manager = SessionManager(store, repository=catalog.sessions)
shared = block_hashes(ns, np.arange(2 * ns.block_tokens))  # a prefix every session shares
i = 0
while True:
    sid = f"session-{i}"
    manager.open(sid, tenant="t", kind="chat" if i % 2 else "agent")
    print("S", sid, flush=True)
    tail = np.random.default_rng(i).integers(0, 50_000, 6 * ns.block_tokens)
    hashes = block_hashes(ns, np.concatenate([np.arange(2 * ns.block_tokens), tail]))
    assert hashes[:2] == shared
    for j in range(0, len(hashes), 2):
        seg = hashes[j : j + 2]
        result = store.writes.put(
            seg,
            [(h * (cfg["size"] // 16))[: cfg["size"]] for h in seg],
            namespace_root=root,
            parent=hashes[j - 1] if j else None,
            durable=True,
        )
        assert not result.dropped, result
        manager.record(sid, hashes[: j + 2], tenant="t")
        print("B", sid, *(h.hex() for h in seg), flush=True)
        manager.lookup(sid, hashes[: j + 2], tenant="t")
    i += 1
"""


def data(h: bytes) -> bytes:
    return (h * (SIZE // 16))[:SIZE]


def run_and_kill(migrated, root, interval: float) -> tuple[list[str], dict[str, list[BlockHash]]]:
    cfg = {
        "url": migrated.url,
        "schema": migrated.schema,
        "root": str(root),
        "capacity": CAPACITY,
        "size": SIZE,
        "interval": interval,
    }
    stderr = root.parent / "child.err"
    with stderr.open("w") as err:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(cfg)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        lines: list[str] = []
        acked: set[str] = set()
        deadline = time.monotonic() + 60
        try:
            assert child.stdout is not None
            while len(acked) < ACKED_BLOCKS:
                line = child.stdout.readline()
                assert line, f"the child died: {stderr.read_text()[-3000:]}"
                assert time.monotonic() < deadline, "the child is too slow"
                lines.append(line)
                if line.startswith("B "):
                    acked.update(line.split()[2:])
        finally:
            os.kill(child.pid, signal.SIGKILL)
            rest, _ = child.communicate()
    assert child.returncode == -signal.SIGKILL
    # Whole lines only: a line cut short by the kill was not acknowledged.
    lines.extend(line + "\n" for line in rest.split("\n")[:-1])
    sessions: list[str] = []
    chains: dict[str, list[BlockHash]] = {}
    for line in lines:
        if not line.endswith("\n"):
            continue
        kind, *fields = line.split()
        if kind == "S":
            sessions.append(fields[0])
            chains[fields[0]] = []
        elif kind == "B":
            chains[fields[0]].extend(BlockHash(bytes.fromhex(h)) for h in fields[1:])
    return sessions, chains


def check_recovery(migrated, root, sessions, chains) -> None:
    # Nothing the kill left behind (an open transaction, SQLite's WAL) blocks a new writer.
    catalog = migrated.catalog()
    disk = DiskTier.open(root, CAPACITY, fsync=False)
    store = TieredStore([CatalogRecoveredTier(disk, catalog)], observers=[catalog])
    report = reconcile(catalog, store)
    assert report.quarantined == 0
    assert report.adopted + report.kept == len(disk.keys())
    catalog.flush()
    assert {r.block_id for r in catalog.block_records("disk")} == set(disk.keys())

    manager = SessionManager(store, repository=catalog.sessions)
    restored = manager.restore()
    assert restored >= len(sessions)
    blocks = {h for chain in chains.values() for h in chain}
    assert len(blocks) >= ACKED_BLOCKS
    for h in blocks:
        assert bytes(store.reads.get(h).numpy()) == data(h), h.hex()
    for sid in sessions:
        session = manager.get(sid, tenant="t")
        assert session.tenant == "t"
        chain = chains[sid]
        if chain:
            assert manager.lookup(sid, chain, tenant="t").num_blocks == len(chain)
    catalog.close()
    store.close()


def test_kill_9_loses_no_acknowledged_block_or_session(migrated, tmp_path):
    root = tmp_path / "disk"
    sessions, chains = run_and_kill(migrated, root, interval=0.05)
    assert len(sessions) >= 2
    check_recovery(migrated, root, sessions, chains)


def test_kill_9_with_everything_still_queued(migrated, tmp_path):
    # A flush interval far longer than the run: no block row was written before the kill,
    # only the synchronous session rows; reconciliation adopts every file.
    root = tmp_path / "disk"
    sessions, chains = run_and_kill(migrated, root, interval=3600.0)
    reader = migrated.catalog()
    assert reader.count_blocks() == 0
    assert {s.id for s in reader.sessions.load_sessions()} >= set(sessions)
    reader.close()
    check_recovery(migrated, root, sessions, chains)
