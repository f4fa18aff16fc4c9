"""Namespaces record their owning tenant in a column of its own (per-tenant namespace bounds).

Existing rows get it from their description (``{"tenant": ..., "namespace": {...}}``).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("namespaces", sa.Column("tenant", sa.String(128), nullable=True))
    op.create_index("ix_namespaces_tenant", "namespaces", ["tenant"])
    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT root, description FROM namespaces")).all()
    owned = []
    for root, description in rows:
        if isinstance(description, str):
            try:
                description = json.loads(description)
            except ValueError:
                continue
        tenant = description.get("tenant") if isinstance(description, dict) else None
        if isinstance(tenant, str):
            owned.append({"root": root, "tenant": tenant})
    if owned:
        conn.execute(sa.text("UPDATE namespaces SET tenant = :tenant WHERE root = :root"), owned)


def downgrade() -> None:
    op.drop_index("ix_namespaces_tenant", table_name="namespaces")
    op.drop_column("namespaces", "tenant")
