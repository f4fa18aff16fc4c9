"""Who an operation runs for: a ``Caller`` is one tenant with the state its carrier keeps for it.

A stream or same-host connection keeps one ``Caller`` for its life: the roots it resolved, the
leases its lookups took (by a key of the connection's own, never the store's lease id) and the
stagings it holds open; all of them go when the connection ends (``drop``). A REST request
makes a fresh one: its leases are named by the store's lease id and outlive it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sessioncache.errors import AuthRefused, InvalidInput, LeaseNotFound, StoreRefused
from sessioncache.hashing import BlockHash, Namespace
from sessioncache.node import CacheNode

if TYPE_CHECKING:
    from sessioncache.operations.stores import Staged

log = logging.getLogger("sessioncache.operations")

MAX_ROOTS = 4096
"""Roots one caller remembers (the oldest is forgotten past this; resolve it again)."""
MAX_LEASES = 4096
"""Live leases one caller may hold."""
MAX_STAGINGS = 1024
"""Stagings one caller may hold open at once."""


@dataclass(slots=True)
class CallerLease:
    """A lease a lookup took for a caller."""

    store_id: str
    hashes: list[BlockHash]
    expires_at: float
    """In the store's clock."""


@dataclass(slots=True)
class Caller:
    """One tenant and what its carrier keeps for it (module docstring)."""

    tenant: str
    keeps_leases: bool = False
    """A connection's caller: its lookups' leases are kept under keys of its own and end with
    it. A REST caller's are named by the store's lease id and outlive the request."""
    roots: dict[bytes, Namespace] = field(default_factory=dict)
    leases: dict[bytes, CallerLease] = field(default_factory=dict)
    stagings: dict[bytes, Staged] = field(default_factory=dict)

    def namespace(self, root: bytes) -> Namespace:
        """The namespace of a root this caller resolved (``StoreRefused`` otherwise)."""
        namespace = self.roots.get(root)
        if namespace is None:
            raise StoreRefused(
                f"root {root.hex()} was not resolved on this connection: RESOLVE first"
            )
        return namespace

    def remember(self, root: bytes, namespace: Namespace) -> None:
        self.roots.pop(root, None)
        self.roots[root] = namespace
        while len(self.roots) > MAX_ROOTS:
            del self.roots[next(iter(self.roots))]

    def room_for_lease(self, now: float) -> None:
        """Refuse a new lease past ``MAX_LEASES`` live ones (expired ones are forgotten)."""
        if len(self.leases) < MAX_LEASES:
            return
        for key in [k for k, v in self.leases.items() if v.expires_at <= now]:
            del self.leases[key]
        if len(self.leases) >= MAX_LEASES:
            raise InvalidInput(f"this connection holds {MAX_LEASES} leases: release some")

    def room_for_staging(self) -> None:
        if len(self.stagings) >= MAX_STAGINGS:
            raise InvalidInput(f"this connection holds {MAX_STAGINGS} stagings: commit or abort")

    def staging(self, key: bytes) -> Staged:
        staging = self.stagings.get(key)
        if staging is None:
            raise StoreRefused(f"no open staging {key.hex()} on this connection")
        return staging


def admit(node: CacheNode, local: bool) -> None:
    """Without API keys the node serves data-plane peers on this host only (as the REST API
    binds loopback only then)."""
    if not node.auth_enabled and not local:
        raise AuthRefused("this node runs without API keys and serves local peers only")


def authenticate(node: CacheNode, api_key: str | None) -> Caller:
    """The caller an API key names (``AuthRefused`` for a missing or unknown key)."""
    tenant = node.tenant_for_key(api_key)
    if tenant is None:
        raise AuthRefused("a valid API key is required in HELLO")
    return Caller(tenant, keeps_leases=True)


def drop(node: CacheNode, caller: Caller) -> tuple[int, int]:
    """Everything a caller holds goes (its connection ended, however it ended): its leases are
    released and its stagings aborted. Returns (live leases released, staged slots freed)."""
    released = 0
    for lease in caller.leases.values():
        try:
            node.store.reads.release(lease.store_id)
            released += 1
        except LeaseNotFound:
            pass  # expired, or released through the REST API
        except Exception:  # the others must go all the same
            log.exception("releasing lease %s of a caller gone failed", lease.store_id)
    caller.leases.clear()
    freed = 0
    for staged in caller.stagings.values():
        node.staged.add(caller.tenant, -staged.charged)
        staged.charged = 0
        try:
            freed += node.store.writes.abort(staged.write)
        except Exception:  # the others must go all the same
            log.exception("aborting staging %s of a caller gone failed", staged.write.id)
    caller.stagings.clear()
    return released, freed
