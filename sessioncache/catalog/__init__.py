"""The durable catalog: block, session and usage rows in SQL (SQLite or PostgreSQL).

* ``models``     SQLAlchemy 2.x tables (the schema is owned by the Alembic ``migrations``)
* ``db``         engines: SQLite in WAL mode under the data directory, or PostgreSQL
* ``migrate``    Alembic driven from code (``sessioncache db upgrade``)
* ``repository`` ``Catalog``: store observer and session repository, written behind
* ``statements`` the write statements of ``Catalog``, built per dialect
* ``reconcile``  start-up reconciliation of the catalog with the durable tiers
"""

from sessioncache.catalog.db import default_url, make_engine, resolve_url
from sessioncache.catalog.reconcile import CatalogRecoveredTier, ReconcileReport, reconcile
from sessioncache.catalog.repository import (
    BlockRecord,
    Catalog,
    CatalogStats,
    UsageSample,
)
from sessioncache.errors import CatalogError, CatalogNotMigrated

__all__ = [
    "BlockRecord",
    "Catalog",
    "CatalogError",
    "CatalogNotMigrated",
    "CatalogRecoveredTier",
    "CatalogStats",
    "ReconcileReport",
    "UsageSample",
    "default_url",
    "make_engine",
    "reconcile",
    "resolve_url",
]
