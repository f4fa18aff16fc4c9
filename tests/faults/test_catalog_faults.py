"""The catalog fails under a serving node: a private PostgreSQL stopped and started again, an
SQLite catalog locked by another process (``BEGIN EXCLUSIVE``), a read-only catalog file at
start. Session calls are answered 503 with ``Retry-After`` within the bounded wait (never 500),
strict readiness says so while it lasts and is back once the catalog is, the block path goes
on, the log has a line per change (not per request), and a catalog that cannot be written at
start is refused with its path."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from sqlalchemy import create_engine, text

from sessioncache.catalog import Catalog, default_url
from tests.support.private_pg import PrivatePostgres
from tests.support.servers import DURABLE_NODE, Server, spawn_server, start_server

NS = {"model": "catalog-faults", "block_tokens": 4, "kv_dtype": "bf16", "kv_layout": "x"}
WAIT = {"SESSIONCACHE_CATALOG_WAIT_S": "1"}
BOUND_S = 5.0
"""What a session call may take while the catalog fails: the 1 s wait with room for a loaded
machine."""

# uvicorn's access lines: one per request, whatever the catalog does
_ACCESS = re.compile(r'^INFO: +\d+\.\d+\.\d+\.\d+:\d+ - "')


def store_chain(c: httpx.Client, seed: int, ns: dict[str, object] = NS) -> list[str]:
    toks = [int(t) for t in np.random.default_rng(seed).integers(0, 9999, 8)]
    plan = c.post("/v1/store", json={"namespace": ns, "tokens": toks})
    assert plan.status_code == 200, plan.text
    for h in plan.json()["missing"]:
        put = c.put(f"/v1/blocks/{h}", content=bytes.fromhex(h) * 8)
        assert put.status_code == 200, put.text
    hit = c.post("/v1/lookup", json={"namespace": ns, "tokens": toks})
    assert hit.status_code == 200 and hit.json()["matched_tokens"] == 8, hit.text
    return list(plan.json()["missing"])


def refused_in_time(c: httpx.Client, session_id: str) -> httpx.Response:
    start = time.monotonic()
    reply = c.post("/v1/sessions", json={"session_id": session_id})
    took = time.monotonic() - start
    print(f"POST /v1/sessions {reply.status_code} in {took:.2f} s")
    assert reply.status_code == 503, reply.text
    assert took < BOUND_S, took
    assert float(reply.headers["Retry-After"]) > 0
    assert reply.json()["error"] == "CatalogUnavailable" and reply.json()["detail"]
    return reply


def strictly(c: httpx.Client) -> httpx.Response:
    return c.get("/readyz", params={"strict": "true"})


def unready(c: httpx.Client) -> str:
    """Strictly not ready: what ``dependencies`` says of the catalog."""
    reply = strictly(c)
    assert reply.status_code == 503, reply.text
    said = reply.json()["dependencies"]["catalog"]
    assert said != "ok", reply.text
    return str(said)


def back(c: httpx.Client, server: Server, offset: int) -> None:
    """Once the catalog is back: strictly ready again, sessions open, and the log since
    ``offset`` (the fault's start) a few lines, no traceback."""
    start = time.monotonic()
    while (reply := strictly(c)).status_code != 200:
        assert time.monotonic() - start < 15, reply.text
        time.sleep(0.1)
    assert reply.json()["dependencies"]["catalog"] == "ok"
    print(f"strictly ready {time.monotonic() - start:.2f} s after the catalog was back")
    assert c.post("/v1/sessions", json={"session_id": "after"}).status_code == 201
    text = server.log.read_bytes()[offset:].decode(errors="replace")
    lines = [line for line in text.splitlines() if line and not _ACCESS.match(line)]
    print(f"{len(lines)} log lines (besides access lines) over the fault:", *lines, sep="\n  ")
    assert len(lines) < 20, lines
    assert not any("Traceback" in line for line in lines), lines
    changes = [
        line for line in lines if re.search(r"catalog .* (unavailable|available again)", line)
    ]
    assert len(changes) == 2 and "available again" in changes[1], changes


@pytest.fixture
def private_pg() -> Iterator[PrivatePostgres]:
    pg = PrivatePostgres()
    try:
        pg.start()
        yield pg
    finally:
        pg.remove()


def test_a_stopped_postgres_catalog_is_answered_503_and_reported(
    tmp_path: Path, private_pg: PrivatePostgres
) -> None:
    server = start_server(
        tmp_path / "data", {**DURABLE_NODE, **WAIT, "SESSIONCACHE_DATABASE_URL": private_pg.url}
    )
    acked: list[str] = []
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert c.post("/v1/sessions", json={"session_id": "before"}).status_code == 201
            acked += store_chain(c, 1)
            assert strictly(c).json()["dependencies"]["catalog"] == "ok"
            offset = server.log.stat().st_size
            private_pg.stop()
            for i in range(2):
                refused_in_time(c, f"during-{i}")
            # the block path goes on: durable stores are answered and read back, in a
            # namespace the node knew and in one it did not (recorded once the catalog is back)
            acked += store_chain(c, 2)
            acked += store_chain(c, 3, {**NS, "model": "first-seen-during-the-outage"})
            assert c.get("/v1/sessions/before").status_code == 200
            unready(c)
            assert "\nsessioncache_catalog_up 0.0" in c.get("/metrics").text
            private_pg.start()
            back(c, server, offset)
            assert "\nsessioncache_catalog_up 1.0" in c.get("/metrics").text
    finally:
        server.stop()  # flushes the write-behind catalog
    admin = create_engine(private_pg.url)
    try:
        with admin.connect() as conn:
            sessions = {r[0] for r in conn.execute(text("select id from sessions")).all()}
            held = {bytes(r[0]).hex() for r in conn.execute(text("select block_id from blocks"))}
            described = [r[0] for r in conn.execute(text("select description from namespaces"))]
    finally:
        admin.dispose()
    assert {"before", "after"} <= sessions and not any(s.startswith("during") for s in sessions)
    assert set(acked) <= held, sorted(set(acked) - held)
    models = {d["namespace"]["model"] for d in described if d}
    assert {NS["model"], "first-seen-during-the-outage"} <= models, described


def lock(catalog: Path) -> subprocess.Popen[bytes]:
    """Another process holding SQLite's ``BEGIN EXCLUSIVE`` on ``catalog`` until its stdin
    closes."""
    locker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys\n"
            f"c = sqlite3.connect({str(catalog)!r}, isolation_level=None)\n"
            "c.execute('BEGIN EXCLUSIVE')\n"
            "print('locked', flush=True)\n"
            "sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert locker.stdout is not None and locker.stdout.readline() == b"locked\n"
    return locker


def test_a_locked_sqlite_catalog_is_answered_503_within_the_wait(tmp_path: Path) -> None:
    server = start_server(tmp_path / "data", WAIT)
    catalog = tmp_path / "data" / "catalog.db"
    locker = None
    try:
        with httpx.Client(base_url=server.url, timeout=20) as c:
            assert c.post("/v1/sessions", json={"session_id": "before"}).status_code == 201
            store_chain(c, 1)
            offset = server.log.stat().st_size
            locker = lock(catalog)
            for i in range(2):
                refused_in_time(c, f"during-{i}")
            store_chain(c, 2)
            # a read goes through a locked SQLite: it does not make the catalog available
            reads = time.monotonic()
            while time.monotonic() - reads < 1.5:
                assert c.get("/v1/sessions/nobody").status_code in (404, 503)
                time.sleep(0.05)
            refused_in_time(c, "during-3")
            assert "locked" in unready(c)
            assert locker.stdin is not None
            locker.stdin.close()
            locker.wait(10)
            back(c, server, offset)
            # stopped while the catalog is locked: a line says what is not written
            locker = lock(catalog)
            offset = server.log.stat().st_size
            refused_in_time(c, "last")
            store_chain(c, 4)  # rows the catalog cannot take now
        server.stop()
        lines = server.log.read_bytes()[offset:].decode(errors="replace")
        assert "Traceback" not in lines and "while closing: " in lines, lines
    finally:
        if locker is not None and locker.poll() is None:
            locker.kill()
            locker.wait()
        server.stop()


@pytest.fixture
def read_only_catalog(tmp_path: Path) -> Iterator[Path]:
    """A data dir whose migrated ``catalog.db`` cannot be written: bind-mounted read-only
    over itself as root (root writes through file modes), else mode 0444."""
    data = tmp_path / "data"
    data.mkdir()
    Catalog.open(default_url(data), migrate=True).close()
    path = data / "catalog.db"
    if os.geteuid() != 0:
        path.chmod(0o444)
        yield path
        return
    for args in (["--bind", str(path), str(path)], ["-o", "remount,bind,ro", str(path)]):
        done = subprocess.run(["mount", *args], capture_output=True, check=False)
        if done.returncode != 0:
            subprocess.run(["umount", str(path)], check=False)
            pytest.skip(f"cannot mount the catalog read-only: {done.stderr!r}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_a_read_only_catalog_is_refused_at_start(read_only_catalog: Path) -> None:
    start = time.monotonic()
    server = spawn_server(read_only_catalog.parent)
    try:
        rc = server.process.wait(30)
    finally:
        server.stop()
    print(f"exit {rc} after {time.monotonic() - start:.2f} s")
    out = server.log.read_text()
    assert rc != 0, out
    assert str(read_only_catalog) in out and "cannot be written" in out, out
    assert "Traceback" not in out and "answered 503" not in out, out


def test_a_sweep_by_hand_refuses_a_read_only_catalog(read_only_catalog: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sessioncache.cli",
            "gc",
            "--data-dir",
            str(read_only_catalog.parent),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert str(read_only_catalog) in done.stderr and "Traceback" not in done.stderr, done.stderr
