"""Settings, read from ``SESSIONCACHE_*`` environment variables (pydantic-settings).

Every field below is documented in README.md's configuration reference; keep the two in step.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

GiB = 1 << 30
DAY_S = 86400.0


class Settings(BaseSettings):
    """The service's configuration; embedded defaults need no external service."""

    model_config = SettingsConfigDict(env_prefix="SESSIONCACHE_", extra="ignore")

    data_dir: Path = Field(Path(".sessioncache"), description="Disk tier and SQLite catalog.")
    gpu_bytes: int = Field(0, ge=0, description="GPU tier capacity; 0 disables the tier.")
    gpu_device: str | None = Field(None, description="torch device of the GPU tier.")
    cpu_bytes: int = Field(4 * GiB, ge=0, description="CPU tier capacity; 0 disables it.")
    disk_bytes: int = Field(64 * GiB, ge=0, description="Disk tier capacity; 0 disables it.")
    default_ttl_s: float = Field(3 * DAY_S, gt=0, description="TTL of blocks with no session.")
    hash_seed: int = Field(0, ge=0, lt=1 << 64, description="Seed of every block id.")
    promote_on_get: bool = Field(True, description="Copy lower-tier hits up into the first tier.")
    max_lease_s: float = Field(3600.0, gt=0, description="Longest lease a lookup may take.")
