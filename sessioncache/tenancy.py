"""Which tenant owns which namespace root.

With authentication on, a tenant's namespace roots are salted with the tenant
(``hashing.tenant_namespace``), so a root belongs to exactly one tenant, and a node serves a
block only to the tenant owning the block's root. ``NamespaceOwners`` remembers the owners in
memory and, through an ``OwnerRepository`` (the catalog's ``namespaces`` table), across
restarts and across the nodes sharing the catalog: a tenant's first request after a restart
may be a block read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, Protocol

from sessioncache.hashing import Namespace


class OwnerRepository(Protocol):
    """Where owners outlive the process (``Catalog`` implements it)."""

    def register_namespace(self, root: bytes, description: dict[str, Any] | None = None) -> None:
        """Record ``root`` with its description, now."""

    def namespaces(self) -> dict[bytes, dict[str, Any] | None]:
        """Every recorded root with its description."""


class NamespaceOwners:
    """Root -> owning tenant; claims are written through to the repository once per root."""

    def __init__(
        self,
        repository: OwnerRepository | None = None,
        *,
        admit: Callable[[str, int], None] | None = None,
    ) -> None:
        """``admit``: admits one more root to a tenant holding so many (``Quotas.admitter``
        of ``namespaces``; None: no bound)."""
        self._repository = repository
        self._owners: dict[bytes, str] = {}
        self._namespaces: dict[bytes, dict[str, Any]] = {}  # the roots' descriptions
        self._roots_of: dict[str, set[bytes]] = {}
        self._lock = threading.Lock()
        self._admit = admit

    def load(self) -> int:
        """Read the owners the repository knows; returns how many."""
        if self._repository is None:
            return 0
        described = {
            bytes(root): description
            for root, description in self._repository.namespaces().items()
            if isinstance(description, dict) and isinstance(description.get("tenant"), str)
        }
        with self._lock:
            for root, description in described.items():
                self._own(root, description["tenant"])
                namespace = description.get("namespace")
                if isinstance(namespace, dict):
                    self._namespaces[root] = namespace
        return len(described)

    def claim(self, root: bytes, tenant: str, namespace: Namespace) -> None:
        """``tenant`` derived ``root`` from ``namespace`` (its unsalted form)."""
        with self._lock:
            if self._owners.get(root) == tenant:
                return
            if self._admit is not None:
                self._admit(tenant, len(self._roots_of.get(tenant, ())))
            before = self._owners.get(root), self._namespaces.get(root)
            self._own(root, tenant)
            self._namespaces[root] = asdict(namespace)
        if self._repository is not None:
            try:
                self._repository.register_namespace(
                    root, {"tenant": tenant, "namespace": asdict(namespace)}
                )
            except BaseException:  # not recorded (the catalog unavailable): not claimed
                with self._lock:
                    self._roots_of[tenant].discard(root)
                    owner, described = before
                    if owner is None:
                        self._owners.pop(root, None)
                    else:
                        self._own(root, owner)
                    if described is None:
                        self._namespaces.pop(root, None)
                    else:
                        self._namespaces[root] = described
                raise

    def _own(self, root: bytes, tenant: str) -> None:
        """``root`` belongs to ``tenant`` now (called with the lock held)."""
        before = self._owners.get(root)
        if before is not None:
            self._roots_of[before].discard(root)
        self._owners[root] = tenant
        self._roots_of.setdefault(tenant, set()).add(root)

    def roots(self, tenant: str) -> list[bytes]:
        """The roots ``tenant`` owns."""
        with self._lock:
            return list(self._roots_of.get(tenant, ()))

    def per_tenant(self) -> dict[str, int]:
        """Roots owned per tenant."""
        with self._lock:
            return {t: len(roots) for t, roots in self._roots_of.items() if roots}

    def owner(self, root: bytes) -> str | None:
        with self._lock:
            return self._owners.get(root)

    def tenant_of(self, root: bytes) -> str:
        """The tenant whose share a block of ``root`` counts in: its owner, ``""`` when the
        root is not known (yet)."""
        with self._lock:
            return self._owners.get(root, "")

    def describe(self, root: bytes) -> tuple[str, dict[str, Any]] | None:
        """(owning tenant, namespace fields) of ``root``, when known."""
        with self._lock:
            tenant = self._owners.get(root)
            if tenant is None:
                return None
            return tenant, dict(self._namespaces.get(root, {}))
