"""The documented deployment files agree with the settings the service reads."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from sessioncache.config import Settings
from tests.support.servers import spawn_server, wait_ready

ROOT = Path(__file__).parents[1]


_VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def interpolate(text: str, variables: Mapping[str, str]) -> str:
    """``text`` with compose's interpolation applied: ``${NAME}``, ``${NAME:-default}`` (the
    default when NAME is unset or empty), ``${NAME-default}`` (when unset) and ``$$``."""

    def value(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, default = m.group(1), m.group(2)
        got = variables.get(name)
        if default is None:
            return got or ""
        if got is None or (got == "" and ":-" in m.group(0)):
            return default
        return got

    return _VARIABLE.sub(value, text)


def compose(variables: Mapping[str, str] | None = None) -> dict[str, Any]:
    """docker-compose.yml as compose reads it, its variables taken from ``variables`` (none set:
    every default)."""
    text = interpolate((ROOT / "docker-compose.yml").read_text(), variables or {})
    data: dict[str, Any] = yaml.safe_load(text)
    return data


def node_environment(name: str, variables: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment compose gives the node service ``name``."""
    return {k: str(v) for k, v in compose(variables)["services"][name]["environment"].items()}


def test_compose_runs_redis_postgres_and_two_nodes():
    services = compose()["services"]
    assert {"redis", "postgres", "node-a", "node-b"} <= set(services)
    for name in ("node-a", "node-b"):
        node = services[name]
        assert node["build"] == "."
        assert set(node["depends_on"]) == {"redis", "postgres"}


def test_every_node_variable_is_a_setting_and_parses(monkeypatch: pytest.MonkeyPatch):
    services = compose()["services"]
    fields = {f"SESSIONCACHE_{name.upper()}" for name in Settings.model_fields}
    node_ids = set()
    for name in ("node-a", "node-b"):
        env = node_environment(name)
        unknown = {k for k in env if k.startswith("SESSIONCACHE_")} - fields
        assert not unknown, f"{name} sets variables the service does not read: {unknown}"
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            settings = Settings()  # read exactly as the service reads its environment
        assert settings.redis_url and settings.redis_url.startswith("redis://redis:")
        assert settings.database_url and "@postgres:5432/" in settings.database_url
        assert settings.api_keys, "a multi-node deployment binds 0.0.0.0: keys are required"
        node_ids.add(settings.node_id)
        container_ports = {int(p.split(":")[1]) for p in services[name]["ports"]}
        assert container_ports == {settings.port, settings.stream_port}
        assert settings.stream_enabled and settings.stream_host == "0.0.0.0"
        # what the node advertises names the node itself, never the address it binds
        assert settings.node_url == f"http://{name}:{settings.port}"
        assert settings.stream_advertise == f"{name}:{settings.stream_port}"
    assert len(node_ids) == 2


def test_advertised_addresses_and_shared_services_are_variables() -> None:
    """On real hosts each node advertises the address the other hosts reach, and the nodes
    reach Redis and PostgreSQL where they run: compose variables set them."""
    variables = {
        "REDIS_URL": "redis://10.0.0.5:6379/0",
        "DATABASE_URL": "postgresql+psycopg://sessioncache@10.0.0.5:5432/sessioncache",
        "NODE_A_URL": "http://10.0.0.11:18080",
        "NODE_A_STREAM": "10.0.0.11:18081",
        "NODE_B_URL": "http://10.0.0.12:18082",
        "NODE_B_STREAM": "10.0.0.12:18083",
    }
    for name, host in (("node-a", "10.0.0.11"), ("node-b", "10.0.0.12")):
        env = node_environment(name, variables)
        assert env["SESSIONCACHE_REDIS_URL"] == variables["REDIS_URL"]
        assert env["SESSIONCACHE_DATABASE_URL"] == variables["DATABASE_URL"]
        assert env["SESSIONCACHE_NODE_URL"].startswith(f"http://{host}:")
        assert env["SESSIONCACHE_STREAM_ADVERTISE"].startswith(f"{host}:")


def test_interpolation_follows_compose() -> None:
    assert interpolate("${A:-x} ${A-y} ${B} $$Z", {}) == "x y  $Z"
    assert interpolate("${A:-x} ${A-y}", {"A": ""}) == "x "
    assert interpolate("${A:-x} ${A-y} ${A}", {"A": "v"}) == "v v v"


def test_published_ports_collide_with_no_local_service() -> None:
    """Redis and PostgreSQL are reached inside the compose network only; the nodes' host ports
    are neither a node's default REST and stream ports nor PostgreSQL's or Redis'."""
    services = compose()["services"]
    assert "ports" not in services["redis"] and "ports" not in services["postgres"]
    host_ports = [
        int(p.split(":")[0]) for name in ("node-a", "node-b") for p in services[name]["ports"]
    ]
    assert len(set(host_ports)) == len(host_ports) == 4
    assert not set(host_ports) & {8080, 8081, 5432, 6379}


def test_service_ports_match_the_servers():
    services = compose()["services"]
    assert services["node-a"]["environment"]["SESSIONCACHE_REDIS_URL"] == (
        "redis://redis:6379/0"  # redis:7 listens on its default port
    )
    db = services["postgres"]["environment"]["POSTGRES_DB"]
    user = services["postgres"]["environment"]["POSTGRES_USER"]
    url = services["node-a"]["environment"]["SESSIONCACHE_DATABASE_URL"]
    assert url.endswith(f"://{user}@postgres:5432/{db}")


def test_dockerfile_installs_the_cpu_torch_and_serves():
    text = (ROOT / "Dockerfile").read_text()
    assert "torch==2.13.0" in text and "sessioncache" in text and "serve" in text


def test_readmes_first_example_stores_then_hits(tmp_path: Path):
    """README's Python example, run as written against a node on README's defaults (its port
    replaced by a free one): a miss, a store, then the whole prompt and a longer one hit."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    (example,) = [b for b in blocks if "SessionCacheClient" in b and "client.store" in b]
    server = wait_ready(spawn_server(tmp_path / "data"))
    try:
        script = example.replace("http://127.0.0.1:8080", server.url)
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
        ).stdout.split()
    finally:
        server.stop()
    assert out == ["0", "64", "64"]
