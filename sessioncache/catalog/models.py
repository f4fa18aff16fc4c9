"""The catalog's tables (SQLAlchemy 2.x declarative models).

Portable across SQLite and PostgreSQL: block ids and namespace roots are 16-byte binaries
(``BLOB`` / ``BYTEA``), times are float epoch seconds (the store's clock), counts are 64-bit
integers. The schema itself is owned by the Alembic migrations in ``migrations/``; keep the two
in step (``tests/sessioncache/catalog/test_migrations.py`` compares them).
"""

from __future__ import annotations

from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeEngine

ID_BYTES = 16
TIER_NAME_LEN = 64
SESSION_ID_LEN = 128
TENANT_LEN = 128
KIND_LEN = 64
COUNTER_NAME_LEN = 128

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[type, TypeEngine[Any] | type[TypeEngine[Any]]]] = {
        bytes: LargeBinary(ID_BYTES),
        float: Double,
        int: BigInteger,
    }
    """The portable types (the module docstring) of a column that names no other: bytes are a
    block id or namespace root, a float is a time, an int a 64-bit count. A column is NOT NULL
    unless its annotation admits None."""


class NamespaceRow(Base):
    """One KV namespace (model, dtype, layout, ...), keyed by its 16-byte root digest."""

    __tablename__ = "namespaces"

    root: Mapped[bytes] = mapped_column(primary_key=True)
    description: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created: Mapped[float]
    tenant: Mapped[str | None] = mapped_column(String(TENANT_LEN))
    """The owning tenant (None: a root no tenant claimed, such as a shared engine's)."""

    __table_args__ = (Index("ix_namespaces_tenant", "tenant"),)


class BlockRow(Base):
    """One block held in one durable tier (a block in two durable tiers has two rows)."""

    __tablename__ = "blocks"

    block_id: Mapped[bytes] = mapped_column(primary_key=True)
    tier: Mapped[str] = mapped_column(String(TIER_NAME_LEN), primary_key=True)
    namespace_root: Mapped[bytes] = mapped_column(ForeignKey("namespaces.root"))
    parent: Mapped[bytes | None]
    nbytes: Mapped[int]
    checksum: Mapped[bytes | None] = mapped_column(LargeBinary(8))
    """The payload's XXH3-64 (8 bytes, big-endian) when known (set by reconciliation)."""
    created: Mapped[float]
    last_access: Mapped[float]
    expires_at: Mapped[float]
    ttl_s: Mapped[float]
    hit_count: Mapped[int] = mapped_column(default=0)
    pin_count: Mapped[int] = mapped_column(Integer, default=0)
    """Pins (leases, sessions) the block had at its last recorded access."""

    __table_args__ = (
        Index("ix_blocks_tier_expires_at", "tier", "expires_at"),
        Index("ix_blocks_namespace_root", "namespace_root"),
    )


class SessionRow(Base):
    """An open agent session (``sessioncache.sessions.manager.Session``)."""

    __tablename__ = "sessions"

    tenant: Mapped[str] = mapped_column(String(TENANT_LEN), primary_key=True)
    id: Mapped[str] = mapped_column(String(SESSION_ID_LEN), primary_key=True)
    kind: Mapped[str] = mapped_column(String(KIND_LEN))
    ttl_s: Mapped[float]
    created: Mapped[float]
    last_seen: Mapped[float]
    expires_at: Mapped[float]
    head: Mapped[bytes | None]

    __table_args__ = (Index("ix_sessions_expires_at", "expires_at"),)


class UsageCounterRow(Base):
    """A dashboard counter: ``value`` accumulated over the bucket starting at ``bucket``."""

    __tablename__ = "usage_counters"

    name: Mapped[str] = mapped_column(String(COUNTER_NAME_LEN), primary_key=True)
    bucket: Mapped[float] = mapped_column(primary_key=True)
    value: Mapped[int] = mapped_column(default=0)

    __table_args__ = (Index("ix_usage_counters_bucket", "bucket"),)


namespaces_table: Table = Base.metadata.tables["namespaces"]
blocks_table: Table = Base.metadata.tables["blocks"]
sessions_table: Table = Base.metadata.tables["sessions"]
usage_table: Table = Base.metadata.tables["usage_counters"]
