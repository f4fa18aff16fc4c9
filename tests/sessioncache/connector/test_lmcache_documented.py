"""The node and ``lmcache server`` on one host, started with exactly the commands of
docs/lmcache.md (read from the page): both come up on their documented ports, and LMCache's
adapter connects to the node over the same-host path."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.servers import stop_group

ROOT_DIR = Path(__file__).resolve().parents[3]
DOC = ROOT_DIR / "docs" / "lmcache.md"
PORTS = (8080, 8081, 8090)
"""The node's REST and stream ports on its defaults, and LMCache's HTTP port in the doc."""


def documented_commands() -> str:
    """The doc's bash block that starts both."""
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    (block,) = [b for b in blocks if "lmcache server" in b and "sessioncache serve" in b]
    return block


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_the_documented_ports_do_not_collide():
    block = documented_commands()
    assert "--http-port 8090" in block
    # sized for a small host: LMCache's L1 (resident at once) beside the node's 4 GiB tier
    (l1,) = re.findall(r"--l1-size-gb (\d+)", block)
    assert int(l1) <= 4
    assert '"url": "http://127.0.0.1:8080"' in block


@pytest.mark.timeout(240)
def test_the_pair_starts_with_the_documented_commands(tmp_path: Path):
    busy = [p for p in PORTS if not port_free(p)]
    if busy:
        pytest.skip(f"ports {busy} are taken on this host")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONCACHE_")}
    env.update(
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
        PYTHONPATH=str(ROOT_DIR),
        LMCACHE_DISABLE_BANNER="1",
        LMCACHE_TRACK_USAGE="false",
    )
    log_path = tmp_path / "pair.log"
    with log_path.open("w+") as log:
        # the block as a user pastes it, in an empty directory (the node's data goes there)
        pair = subprocess.Popen(
            ["bash", "-c", documented_commands() + "\nwait\n"],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 150
            text = ""
            while time.monotonic() < deadline and pair.poll() is None:
                text = log_path.read_text()
                if "cache server is running" in text:
                    break
                time.sleep(0.5)
            assert "cache server is running" in text, text[-3000:]
            assert httpx.get("http://127.0.0.1:8080/healthz", timeout=5).status_code == 200
            plane = httpx.get("http://127.0.0.1:8080/v1/dataplane", timeout=5).json()
            assert str(plane["stream"]).endswith(":8081"), plane
            assert int(plane["same_host_connections"]) >= 1, plane
            assert not port_free(8090)  # LMCache's HTTP API is up on its documented port
        finally:
            stop_group(pair)
