"""``sessioncache info``: the configured tiers and what they hold, run as the real command."""

from __future__ import annotations

from pathlib import Path

from sessioncache import __version__
from sessioncache.config import Settings
from sessioncache.factory import build_store
from sessioncache.hashing import BlockHash
from tests.support.cli import run_cli_json

NS = b"info-test-namesp"
SIZE = 1000
CPU, DISK = 1 << 20, 4 << 20


def env_for(data: Path) -> dict[str, str]:
    return {
        "SESSIONCACHE_DATA_DIR": str(data),
        "SESSIONCACHE_CPU_BYTES": str(CPU),
        "SESSIONCACHE_DISK_BYTES": str(DISK),
    }


def tier(name: str, used: int, blocks: int, capacity: int, durable: bool) -> dict[str, object]:
    return {
        "name": name,
        "capacity_bytes": capacity,
        "used_bytes": used,
        "blocks": blocks,
        "durable": durable,
        "pinned_bytes": 0,
        "room_bytes": capacity,  # a tmp filesystem with room beyond the tier's capacity
    }


def test_info_reports_what_the_disk_tier_of_the_data_dir_holds(tmp_path: Path):
    data = tmp_path / "data"
    store = build_store(Settings(data_dir=data, cpu_bytes=CPU, disk_bytes=DISK))
    ids = [BlockHash(i.to_bytes(16, "little")) for i in (1, 2, 3)]
    assert store.writes.put(ids, [b"x" * SIZE] * 3, namespace_root=NS, durable=True).stored == ids
    store.close()

    out = run_cli_json("info", env=env_for(data))

    # The CPU tier does not outlive the process; the disk tier's three blocks do.
    assert out == {
        "version": __version__,
        "data_dir": str(data),
        "blocks": 3,
        "tiers": [
            tier("cpu", 0, 0, CPU, durable=False),
            tier("disk", 3 * SIZE, 3, DISK, durable=True),
        ],
    }
