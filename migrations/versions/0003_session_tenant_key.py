"""Session ids are scoped by tenant: the sessions table's key is (tenant, id).

Existing rows keep their tenant and id. ``ix_sessions_tenant`` goes: the key's first column
serves the per-tenant queries. A downgrade keeps, for an id two tenants share, the row seen
last (the old key holds one session per id).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_index("ix_sessions_tenant", table_name="sessions")
    with op.batch_alter_table("sessions") as batch:  # SQLite: the table is copied
        batch.drop_constraint("pk_sessions", type_="primary")
        batch.create_primary_key("pk_sessions", ["tenant", "id"])


def downgrade() -> None:
    conn = op.get_bind()
    conn.execute(
        sa.text(
            "DELETE FROM sessions WHERE EXISTS (SELECT 1 FROM sessions AS later"
            " WHERE later.id = sessions.id AND (later.last_seen > sessions.last_seen"
            " OR (later.last_seen = sessions.last_seen AND later.tenant > sessions.tenant)))"
        )
    )
    with op.batch_alter_table("sessions") as batch:
        batch.drop_constraint("pk_sessions", type_="primary")
        batch.create_primary_key("pk_sessions", ["id"])
    op.create_index("ix_sessions_tenant", "sessions", ["tenant"])
