"""Regenerate ``docs/dashboard.png``: a service with agent traffic from three tenants through
the client library (a CPU tier small enough to evict), then the dashboard in headless
Chromium after ``seconds`` of it. Not a test; run from the repository root:

    python tests/support/dashboard_screenshot.py [seconds] [out.png]
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from tempfile import TemporaryDirectory

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "screenshot-admin-token"
BLOCK = 64 << 10
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def main(seconds: float, out: Path) -> None:
    # this tree's tests/, not another "tests" package the environment may have installed
    package = types.ModuleType("tests")
    package.__path__ = [str(ROOT / "tests")]
    sys.modules["tests"] = package
    sys.path.insert(0, str(ROOT))
    import numpy as np
    from playwright.sync_api import sync_playwright

    from sessioncache.connector import SessionCacheClient
    from tests.support.servers import start_server
    from tests.support.traffic import BLOCK_TOKENS, MODELS

    keys = {"k-acme": "acme", "k-globex": "globex", "k-initech": "initech"}
    with TemporaryDirectory(prefix="sessioncache-shot-") as tmp:
        server = start_server(
            Path(tmp) / "data",
            {
                "SESSIONCACHE_API_KEYS": json.dumps(keys),
                "SESSIONCACHE_ADMIN_TOKEN": TOKEN,
                "SESSIONCACHE_HISTORY_INTERVAL_S": "2",
                "SESSIONCACHE_CPU_BYTES": str(24 << 20),
                "SESSIONCACHE_DISK_BYTES": str(256 << 20),
                "SESSIONCACHE_PREFILL_TOKENS_PER_S": "8000",
            },
        )
        stop = threading.Event()

        def agent(key: str, model: int, seed: int, sessions: int) -> None:
            rng = np.random.default_rng(seed)
            system = [int(t) for t in rng.integers(0, 32000, BLOCK_TOKENS * 6)]
            conversations: dict[str, list[int]] = {}
            with SessionCacheClient(
                server.url, namespace=MODELS[model], api_key=key, timeout=60
            ) as client:
                while not stop.is_set():
                    s = int(rng.integers(0, sessions))
                    sid = f"{key[2:]}-agent-{s:03d}"
                    if sid not in conversations:
                        client.open_session(sid, kind="agent" if s % 3 else "chat")
                        conversations[sid] = list(system)
                    turn = int(rng.integers(1, 4)) * BLOCK_TOKENS
                    conversation = conversations[sid]
                    conversation += [int(t) for t in rng.integers(0, 32000, turn)]
                    if len(conversation) > BLOCK_TOKENS * 40:  # a new task in the session
                        conversations[sid] = conversation = system + conversation[-64:]
                    hit = client.lookup(conversation, session_id=sid)
                    if hit.hashes:
                        client.load(hit.hashes)
                    client.store(conversation, lambda i: bytes([i % 251]) * BLOCK, session_id=sid)
                    time.sleep(0.05)

        workers = [
            threading.Thread(target=agent, args=args, daemon=True)
            for args in (("k-acme", 0, 1, 30), ("k-globex", 1, 2, 15), ("k-initech", 0, 3, 8))
        ]
        for worker in workers:
            worker.start()
        try:
            time.sleep(seconds)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"{server.url}/admin")
                page.fill("#token", TOKEN)
                page.click("#login-form button[type=submit]")
                page.wait_for_selector("#chart-hit canvas")
                page.wait_for_timeout(4500)
                page.screenshot(path=str(out), full_page=True)
                browser.close()
            cli = [sys.executable, "-m", "sessioncache.cli", "stats", "--url", server.url]
            print(subprocess.run([*cli, "--token", TOKEN], capture_output=True, text=True).stdout)
        finally:
            stop.set()
            for worker in workers:
                worker.join(30)
            server.stop()


if __name__ == "__main__":
    main(
        float(sys.argv[1]) if len(sys.argv) > 1 else 75.0,
        Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "docs" / "dashboard.png",
    )
