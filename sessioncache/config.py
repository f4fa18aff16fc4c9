"""Settings, read from ``SESSIONCACHE_*`` environment variables and an optional TOML file
(``SESSIONCACHE_CONFIG=/etc/sessioncache.toml``; the environment wins over the file).

Every field below is documented in README.md's configuration reference; keep the two in step.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

GiB = 1 << 30
MiB = 1 << 20
DAY_S = 86400.0


class Settings(BaseSettings):
    """The service's configuration; embedded defaults need no external service."""

    model_config = SettingsConfigDict(env_prefix="SESSIONCACHE_", extra="ignore")

    # -- tiers
    data_dir: Path = Field(Path(".sessioncache"), description="Disk tier and SQLite catalog.")
    gpu_bytes: int = Field(0, ge=0, description="GPU tier capacity; 0 disables the tier.")
    gpu_device: str | None = Field(None, description="torch device of the GPU tier.")
    cpu_bytes: int = Field(4 * GiB, ge=0, description="CPU tier capacity; 0 disables it.")
    disk_bytes: int = Field(64 * GiB, ge=0, description="Disk tier capacity; 0 disables it.")
    default_ttl_s: float = Field(3 * DAY_S, gt=0, description="TTL of blocks with no session.")
    hash_seed: int = Field(0, ge=0, lt=1 << 64, description="Seed of every block id.")
    promote_on_get: bool = Field(True, description="Copy lower-tier hits up into the first tier.")
    max_lease_s: float = Field(3600.0, gt=0, description="Longest lease a lookup may take.")

    # -- sessions
    agent_ttl_s: float = Field(3 * DAY_S, gt=0, description="Sliding TTL of agent sessions.")
    chat_ttl_s: float = Field(7 * DAY_S, gt=0, description="Sliding TTL of chat sessions.")
    session_kinds: dict[str, float] = Field(
        default_factory=dict, description="Extra session kinds: name -> TTL seconds."
    )
    idle_timeout_s: float = Field(300.0, gt=0, description="Idle time that releases pins.")
    pin_share: float = Field(0.5, ge=0, le=1, description="Share of a tier pins may hold.")
    sweep_interval_s: float = Field(60.0, gt=0, description="Period of the background sweep.")

    # -- catalog
    database_url: str | None = Field(
        None, description="SQLAlchemy URL; default SQLite under data_dir."
    )
    database_schema: str | None = Field(None, description="PostgreSQL schema of the catalog.")
    migrate_on_start: bool = Field(True, description="Run migrations when the service starts.")
    catalog_flush_interval_s: float = Field(
        0.2, gt=0, description="Period of the catalog's write-behind flush."
    )
    reconcile_verify: bool = Field(
        True, description="On start, read back disk files the catalog lacks to verify them."
    )

    # -- shared tier and fleet (Redis)
    redis_url: str | None = Field(
        None, description="redis://host:port/db or redis+cluster://host:port; none: no sharing."
    )
    redis_bytes: int = Field(64 * GiB, gt=0, description="This node's budget in the shared tier.")
    redis_prefix: str = Field("sc:", min_length=1, description="Prefix of every Redis key.")
    redis_write_policy: Literal["write_through", "write_back"] = Field(
        "write_through",
        description="write_through: every stored block also goes to Redis; write_back: only "
        "blocks demoted from the last local tier do.",
    )
    node_id: str = Field(
        default_factory=socket.gethostname, description="This node's name in the fleet index."
    )
    node_url: str | None = Field(None, description="Where other nodes reach this one.")
    fleet_ttl_s: float = Field(15.0, gt=0, description="Heartbeat expiry of a node's entry.")

    # -- service
    host: str = Field("127.0.0.1", description="Address `sessioncache serve` binds.")
    port: int = Field(8080, ge=0, lt=65536, description="Port `sessioncache serve` binds.")
    api_keys: dict[str, str] = Field(
        default_factory=dict, description="Bearer API key -> tenant; empty runs open."
    )
    max_body_bytes: int = Field(256 * MiB, gt=0, description="Largest request body accepted.")
    max_tokens: int = Field(2_000_000, gt=0, description="Most tokens in one request.")
    durable_uploads: bool = Field(
        True, description="Write uploaded blocks through to the disk tier before answering."
    )
    upload_ttl_s: float = Field(600.0, gt=0, description="How long a store's PUT slots stay open.")

    def kind_ttls(self) -> dict[str, float]:
        return {"agent": self.agent_ttl_s, "chat": self.chat_ttl_s, **self.session_kinds}

    def catalog_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'catalog.db').resolve()}"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        toml_path = os.environ.get("SESSIONCACHE_CONFIG")
        if toml_path:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=Path(toml_path)))
        return tuple(sources)
