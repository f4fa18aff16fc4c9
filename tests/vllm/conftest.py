"""The node the vLLM tests' engines share (one per test module)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.support.servers import Server, start_server

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
