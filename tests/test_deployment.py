"""The documented deployment files agree with the settings the service reads."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from sessioncache.config import Settings
from tests.support.servers import spawn_server, wait_ready

ROOT = Path(__file__).parents[1]


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


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
        env = {k: str(v) for k, v in services[name]["environment"].items()}
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
        container_port = int(services[name]["ports"][0].split(":")[1])
        assert container_port == settings.port
    assert len(node_ids) == 2


def test_service_ports_match_the_servers():
    services = compose()["services"]
    assert services["redis"]["ports"] == ["6379:6379"]
    assert services["postgres"]["ports"] == ["5432:5432"]
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
