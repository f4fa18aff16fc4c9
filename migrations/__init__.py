"""Alembic environment of the catalog (driven by ``sessioncache.catalog.migrate``)."""
