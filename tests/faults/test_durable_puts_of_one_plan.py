"""The PUTs of one REST store plan, every other one durable, sent at once: each durable one
answers ``durable: true``, the others answer too, and after ``kill -9`` right after the answers
every block answered ``durable: true`` is on the disk. (In-process, deterministically:
tests/sessioncache/test_write_behind.py, the requests filling one write.)"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx

from tests.support.servers import Server, start_server, wait_adopted

NS = {"model": "durable-puts", "block_tokens": 16, "kv_dtype": "u8", "kv_layout": "x"}
BLOCKS = 16
BLOCK = 64 << 10
ROUNDS = 4


def payload(h: str) -> bytes:
    return (bytes.fromhex(h) * (BLOCK // 16))[:BLOCK]


def put(client: httpx.Client, h: str, durable: bool, start: threading.Barrier) -> dict[str, object]:
    """PUT one block, again while its parent is not held yet (a chain is stored in order)."""
    start.wait()
    deadline = time.monotonic() + 30
    while True:
        r = client.put(f"/v1/blocks/{h}", params={"durable": durable}, content=payload(h))
        if r.status_code != 507 or "parent" not in r.text or time.monotonic() > deadline:
            assert r.status_code == 200, r.text
            answer: dict[str, object] = r.json()
            return answer
        time.sleep(0.002)


def store_plan(client: httpx.Client, seed: int) -> dict[str, bool]:
    """One plan of ``BLOCKS`` blocks, each PUT from its own thread, every other one durable;
    what each block's answer said of ``durable``."""
    tokens = [seed * 10_000 + t for t in range(BLOCKS * 16)]
    missing = client.post("/v1/store", json={"namespace": NS, "tokens": tokens}).json()["missing"]
    assert len(missing) == BLOCKS
    start = threading.Barrier(BLOCKS)
    answers: dict[str, dict[str, object]] = {}
    errors: list[BaseException] = []

    def one(i: int, h: str) -> None:
        try:
            answers[h] = put(client, h, i % 2 == 0, start)
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i, h)) for i, h in enumerate(missing)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    asked = [h for i, h in enumerate(missing) if i % 2 == 0]
    refused = [h for h in asked if answers[h]["durable"] is not True]
    assert not refused, f"{len(refused)} of {len(asked)} durable PUTs answered not durable"
    return {h: answers[h]["durable"] is True for h in missing}


def test_concurrent_puts_of_one_plan_keep_each_its_own_durability(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server: Server = start_server(data)
    answered: dict[str, bool] = {}
    try:
        limits = httpx.Limits(max_connections=BLOCKS)
        with httpx.Client(base_url=server.url, timeout=30, limits=limits) as client:
            for seed in range(ROUNDS):
                answered |= store_plan(client, seed)
    finally:
        server.process.send_signal(signal.SIGKILL)
        assert server.process.wait(10) == -signal.SIGKILL
    durable = [h for h, said in answered.items() if said]
    assert len(durable) >= ROUNDS * BLOCKS // 2
    server = start_server(data)
    try:
        wait_adopted(server)
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for h in durable:
                r = client.get(f"/v1/blocks/{h}")
                assert r.status_code == 200, f"block {h} answered durable is lost"
                assert r.content == payload(h), f"block {h} is torn"
    finally:
        server.stop()
