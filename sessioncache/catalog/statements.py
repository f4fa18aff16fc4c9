"""The catalog's write statements, built once per dialect: the upserts differ between
PostgreSQL and SQLite (``INSERT ... ON CONFLICT`` from each dialect's ``insert``).

The bind parameters are named after the table's prefix (``b_`` for ``blocks``, ``s_`` for
``sessions``) so that they never clash with column names; ``Catalog`` fills them in.
"""

from __future__ import annotations

from sqlalchemy import Executable, bindparam, delete, func, update

from sessioncache.catalog.models import (
    blocks_table,
    namespaces_table,
    sessions_table,
    usage_table,
)


class Statements:
    """The write statements, built once for the dialect (upserts differ)."""

    def __init__(self, dialect: str) -> None:
        if dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]

        b, s, n, u = blocks_table, sessions_table, namespaces_table, usage_table
        block_insert = insert(b)
        mutable = [c.name for c in b.columns if c.name not in ("block_id", "tier", "checksum")]
        self.upsert_block: Executable = block_insert.on_conflict_do_update(
            index_elements=[b.c.block_id, b.c.tier],
            set_={
                **{name: block_insert.excluded[name] for name in mutable},
                "checksum": func.coalesce(block_insert.excluded.checksum, b.c.checksum),
            },
        )
        self.delete_block: Executable = delete(b).where(
            b.c.block_id == bindparam("b_id"), b.c.tier == bindparam("b_tier")
        )
        self.touch_block: Executable = (
            update(b)
            .where(b.c.block_id == bindparam("b_id"))
            .values(
                last_access=bindparam("b_last_access"),
                expires_at=bindparam("b_expires_at"),
                hit_count=bindparam("b_hit_count"),
                pin_count=bindparam("b_pin_count"),
                ttl_s=bindparam("b_ttl_s"),
            )
        )
        self.insert_namespace: Executable = insert(n).on_conflict_do_nothing(
            index_elements=[n.c.root]
        )
        ns_insert = insert(n)
        self.upsert_namespace_description: Executable = ns_insert.on_conflict_do_update(
            index_elements=[n.c.root],
            set_={
                "description": ns_insert.excluded.description,
                "tenant": ns_insert.excluded.tenant,
            },
        )
        session_insert = insert(s)
        self.upsert_session: Executable = session_insert.on_conflict_do_update(
            index_elements=[s.c.tenant, s.c.id],
            set_={
                c.name: session_insert.excluded[c.name]
                for c in s.columns
                if c.name not in ("tenant", "id")
            },
        )
        self.save_session: Executable = (
            update(s)
            .where(s.c.tenant == bindparam("s_tenant"), s.c.id == bindparam("s_id"))
            .values(
                ttl_s=bindparam("s_ttl_s"),
                last_seen=bindparam("s_last_seen"),
                expires_at=bindparam("s_expires_at"),
                head=bindparam("s_head"),
            )
        )
        usage_insert = insert(u)
        self.add_usage: Executable = usage_insert.on_conflict_do_update(
            index_elements=[u.c.name, u.c.bucket],
            set_={"value": u.c.value + usage_insert.excluded.value},
        )
