"""The catalog's PostgreSQL backends terminated (``pg_terminate_backend``) under load, several
times: the node reconnects by itself and loses no acknowledged session or durable-block row.
Only this test's backends are terminated: the node connects with an ``application_name`` of
the test's own, into a schema of its own."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from sqlalchemy import create_engine, text

from tests.sessioncache.catalog.conftest import postgres_url
from tests.support.servers import DURABLE_NODE, start_server

NS = {"model": "pg-terminate", "block_tokens": 4, "kv_dtype": "bf16", "kv_layout": "x"}


@pytest.fixture
def pg_schema() -> Iterator[tuple[str, str]]:
    url = postgres_url()
    schema = f"t_{uuid.uuid4().hex[:16]}"
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield url, schema
    finally:
        with engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        engine.dispose()


def test_terminated_backends_lose_no_acknowledged_row(
    tmp_path: Path, pg_schema: tuple[str, str]
) -> None:
    url, schema = pg_schema
    app = f"sc-f14-{uuid.uuid4().hex[:8]}"
    server = start_server(
        tmp_path / "data",
        {
            **DURABLE_NODE,
            "SESSIONCACHE_DATABASE_URL": f"{url}?application_name={app}",
            "SESSIONCACHE_DATABASE_SCHEMA": schema,
        },
    )
    sessions: list[str] = []
    blocks: list[str] = []
    failures: list[str] = []
    done = threading.Event()

    def load() -> None:
        rng = np.random.default_rng(1)
        with httpx.Client(base_url=server.url, timeout=30) as c:
            i = 0
            while not done.is_set():
                sid = f"s-{i}"
                try:
                    r = c.post("/v1/sessions", json={"session_id": sid})
                    r.raise_for_status()
                    sessions.append(sid)
                    toks = [int(t) for t in rng.integers(0, 999, 8)]
                    plan = c.post(
                        "/v1/store", json={"namespace": NS, "tokens": toks, "session_id": sid}
                    ).json()
                    for h in plan["missing"]:
                        put = c.put(f"/v1/blocks/{h}", content=b"p" * 128)
                        put.raise_for_status()
                        assert put.json()["durable"]
                        blocks.append(h)
                except (httpx.HTTPError, AssertionError) as exc:
                    failures.append(f"{i}: {exc!r}")
                i += 1

    admin = create_engine(url)
    killed = 0
    try:
        thread = threading.Thread(target=load, daemon=True)
        thread.start()
        for _ in range(3):
            time.sleep(0.7)
            with admin.begin() as conn:
                killed += len(
                    conn.execute(
                        text(
                            "select pg_terminate_backend(pid) from pg_stat_activity "
                            "where application_name = :app"
                        ),
                        {"app": app},
                    ).all()
                )
        time.sleep(0.7)
        done.set()
        thread.join(30)
    finally:
        done.set()
        server.stop()  # flushes the write-behind catalog
    try:
        assert killed > 0
        assert not failures, failures[:5]
        assert sessions and blocks
        with admin.begin() as conn:
            rows = {r[0] for r in conn.execute(text(f'select id from "{schema}".sessions')).all()}
            assert set(sessions) <= rows, sorted(set(sessions) - rows)[:5]
            held = {
                bytes(r[0]).hex()
                for r in conn.execute(text(f'select block_id from "{schema}".blocks')).all()
            }
            assert set(blocks) <= held, sorted(set(blocks) - held)[:5]
    finally:
        admin.dispose()
