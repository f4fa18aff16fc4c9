"""A fresh node makes its memory ahead of its first store: its CPU tier's segments in the
background from start, staging chunks for the same-host connections to come, and each
connection's first staging chunk at its HELLO (a real ``sessioncache serve``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from sessioncache.config import Settings
from sessioncache.connector.samehost import SameHostClient
from sessioncache.dataplane.staging import STAGING_SEGMENT_BASE
from tests.sessioncache.dataplane.conftest import rest, wait_until
from tests.support.servers import Server, start_server

CPU_BYTES = 256 << 20  # four 64 MiB chunks


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("made-ahead") / "data", {"SESSIONCACHE_CPU_BYTES": str(CPU_BYTES)}
    )
    yield server
    server.stop()


def memfds(pid: int, tag: str) -> int:
    """How many memfd segments named ``sessioncache-<tag>-`` process ``pid`` holds open (a
    mapped one has two descriptors: its own and the mapping's)."""
    names = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"/memfd:sessioncache-{tag}-"):
            names.add(target)
    return len(names)


def test_a_fresh_node_makes_its_cpu_tier_without_any_store(fresh: Server) -> None:
    wait_until(lambda: memfds(fresh.process.pid, "cpu") == CPU_BYTES >> 26)
    cpu = next(t for t in rest(fresh, "/v1/stats")["tiers"] if t["name"] == "cpu")
    assert cpu["used_bytes"] == 0  # nothing stored: every segment was made ahead
    wait_until(lambda: memfds(fresh.process.pid, "staging") == 4)  # one STAGE's worth


def test_a_same_host_connection_has_its_staging_chunk_after_hello(fresh: Server) -> None:
    wait_until(lambda: memfds(fresh.process.pid, "staging") == 4)
    socket_path = rest(fresh, "/v1/dataplane")["same_host"]
    with SameHostClient.connect(socket_path, timeout=30) as client:
        ok, fds = client._maps._call([])  # SEGMENTS: answered after the HELLO's chunk is taken
        for fd in fds:
            os.close(fd)
        assert [s for s in ok.live if s >= STAGING_SEGMENT_BASE], "no staging chunk after HELLO"
        wait_until(lambda: memfds(fresh.process.pid, "staging") == 5)  # the spares refilled
    wait_until(lambda: memfds(fresh.process.pid, "staging") == 4)  # its chunk went with it


def test_the_earlier_boolean_preallocate_setting_still_reads() -> None:
    assert Settings(cpu_preallocate=True).cpu_preallocate == "wait"
    assert Settings(cpu_preallocate="false").cpu_preallocate == "off"
    assert Settings().cpu_preallocate == "background"
