"""The device paths, parametrised over the device: ``cpu`` everywhere (CI), ``cuda`` where a
GPU is present (``bench/gpu_check.py`` runs them there). Nothing here needs PostgreSQL or
Redis: nodes run on their embedded defaults (SQLite catalog, CPU tier in shared memory, disk
tier), as a bare GPU machine has them."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from tests.support.servers import Server, start_server

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
KEYS = {"key-acme": "acme", "key-globex": "globex"}


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A node with two tenants, both trusted with the same-host path, and a CPU tier of
    256 MiB in shared memory (registered with CUDA on a GPU host)."""
    server = start_server(
        tmp_path_factory.mktemp("gpu-node") / "data",
        {
            "SESSIONCACHE_API_KEYS": json.dumps(KEYS),
            "SESSIONCACHE_SHM_TRUSTED_TENANTS": json.dumps(sorted(KEYS.values())),
            "SESSIONCACHE_CPU_BYTES": str(256 << 20),
            "SESSIONCACHE_MAX_BODY_BYTES": str(64 << 20),
        },
    )
    yield server
    server.stop()


def host_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes, wherever it lies."""
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())


def pattern(seed: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` random bytes on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).to(device)
