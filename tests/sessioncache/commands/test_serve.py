"""``sessioncache serve`` binds a non-loopback address only when API keys are configured."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from sessioncache.commands.serve import is_loopback
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
