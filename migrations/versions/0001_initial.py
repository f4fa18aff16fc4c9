"""Initial catalog: namespaces, blocks in durable tiers, sessions, usage counters.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "namespaces",
        sa.Column("root", sa.LargeBinary(16), nullable=False),
        sa.Column("description", sa.JSON(), nullable=True),
        sa.Column("created", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("root", name="pk_namespaces"),
    )
    op.create_table(
        "blocks",
        sa.Column("block_id", sa.LargeBinary(16), nullable=False),
        sa.Column("tier", sa.String(64), nullable=False),
        sa.Column("namespace_root", sa.LargeBinary(16), nullable=False),
        sa.Column("parent", sa.LargeBinary(16), nullable=True),
        sa.Column("nbytes", sa.BigInteger(), nullable=False),
        sa.Column("checksum", sa.LargeBinary(8), nullable=True),
        sa.Column("created", sa.Double(), nullable=False),
        sa.Column("last_access", sa.Double(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.Column("ttl_s", sa.Double(), nullable=False),
        sa.Column("hit_count", sa.BigInteger(), nullable=False),
        sa.Column("pin_count", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["namespace_root"],
            ["namespaces.root"],
            name="fk_blocks_namespace_root_namespaces",
        ),
        sa.PrimaryKeyConstraint("block_id", "tier", name="pk_blocks"),
    )
    op.create_index("ix_blocks_tier_expires_at", "blocks", ["tier", "expires_at"])
    op.create_index("ix_blocks_namespace_root", "blocks", ["namespace_root"])
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(128), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("ttl_s", sa.Double(), nullable=False),
        sa.Column("created", sa.Double(), nullable=False),
        sa.Column("last_seen", sa.Double(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.Column("head", sa.LargeBinary(16), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_sessions"),
    )
    op.create_index("ix_sessions_tenant", "sessions", ["tenant"])
    op.create_index("ix_sessions_expires_at", "sessions", ["expires_at"])
    op.create_table(
        "usage_counters",
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("bucket", sa.Double(), nullable=False),
        sa.Column("value", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name", "bucket", name="pk_usage_counters"),
    )
    op.create_index("ix_usage_counters_bucket", "usage_counters", ["bucket"])


def downgrade() -> None:
    op.drop_index("ix_usage_counters_bucket", table_name="usage_counters")
    op.drop_table("usage_counters")
    op.drop_index("ix_sessions_expires_at", table_name="sessions")
    op.drop_index("ix_sessions_tenant", table_name="sessions")
    op.drop_table("sessions")
    op.drop_index("ix_blocks_namespace_root", table_name="blocks")
    op.drop_index("ix_blocks_tier_expires_at", table_name="blocks")
    op.drop_table("blocks")
    op.drop_table("namespaces")
