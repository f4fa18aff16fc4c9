"""``sessioncache serve`` binds a non-loopback address only when API keys are configured, and
runs with glibc's non-temporal copy threshold lowered unless told otherwise."""

from __future__ import annotations

import json
import os
import platform
import socket
from pathlib import Path

import httpx

from sessioncache.dataplane.transport import is_loopback
from tests.support.cli import run_cli
from tests.support.servers import free_port, start_server


def test_only_loopback_addresses_count_as_loopback():
    for host in ("127.0.0.1", "127.1.2.3", "::1", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "192.0.2.2", "10.1.2.3", "fd00::2", "example.com", ""):
        assert not is_loopback(host), host


def test_serve_refuses_a_non_loopback_address_without_api_keys(tmp_path: Path):
    data = tmp_path / "data"
    # Were it to serve instead, the timeout kills it and the test fails.
    done = run_cli(
        "serve",
        "--host",
        "0.0.0.0",
        "--port",
        str(free_port()),
        "--data-dir",
        str(data),
        env={"SESSIONCACHE_API_KEYS": "{}"},
        timeout_s=60,
    )
    assert done.returncode == 2
    assert "refusing to serve on 0.0.0.0 without API keys" in done.stderr
    assert "SESSIONCACHE_API_KEYS" in done.stderr  # it says how to fix it
    assert not data.exists()  # refused before opening anything


def test_serve_binds_a_non_loopback_address_with_api_keys(tmp_path: Path):
    server = start_server(
        tmp_path / "data",
        {"SESSIONCACHE_HOST": "0.0.0.0", "SESSIONCACHE_API_KEYS": json.dumps({"key-1": "t1"})},
    )
    try:
        r = httpx.get(f"{server.url}/v1/whoami", headers={"authorization": "Bearer key-1"})
        assert r.json() == {"tenant": "t1", "auth": True}
        assert httpx.get(f"{server.url}/v1/whoami").status_code == 401
    finally:
        server.stop()
    assert f"running on http://0.0.0.0:{server.port}" in server.log.read_text()


def test_the_non_temporal_threshold_is_lowered_unless_the_operator_set_tunables():
    from sessioncache.commands.serve import NON_TEMPORAL_TUNABLE, tuned_environment

    env = tuned_environment({"PATH": "/bin"})
    if platform.machine() in ("x86_64", "AMD64") and platform.libc_ver()[0] == "glibc":
        assert env == {"PATH": "/bin", "GLIBC_TUNABLES": NON_TEMPORAL_TUNABLE}
    else:
        assert env is None
    assert tuned_environment({"GLIBC_TUNABLES": ""}) is None  # even empty: theirs
    assert tuned_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) is None


def test_serve_runs_under_the_lowered_threshold(tmp_path: Path):
    from sessioncache.commands.serve import tuned_environment

    server = start_server(tmp_path / "data")
    try:
        environ = Path(f"/proc/{server.process.pid}/environ").read_bytes().split(b"\0")
        tunables = [e for e in environ if e.startswith(b"GLIBC_TUNABLES=")]
        expected = (tuned_environment(os.environ) or dict(os.environ)).get("GLIBC_TUNABLES")
        if expected is None:
            assert tunables == []
        else:
            assert tunables == [f"GLIBC_TUNABLES={expected}".encode()]
        assert httpx.get(f"{server.url}/healthz").status_code == 200  # the same pid serves
    finally:
        server.stop()


def test_serve_exits_saying_why_when_the_stream_port_is_taken(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_cli(
            "serve",
            "--port",
            str(free_port()),
            "--stream-port",
            str(port),
            "--data-dir",
            str(tmp_path / "data"),
            timeout_s=60,
        )
    assert done.returncode != 0
    assert f"cannot serve the block stream on 127.0.0.1:{port}: " in done.stderr
    assert "(set SESSIONCACHE_STREAM_PORT, or SESSIONCACHE_STREAM_ENABLED=false)" in done.stderr
