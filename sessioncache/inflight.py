"""Bytes each tenant's requests hold in receive buffers now, bounded per tenant.

A request charges its tenant as its buffers grow with the bytes it has received (never for
what it only declares: ``buffers.Filling``) and gives the charge back when it ends. A charge
past the tenant's bound raises ``QuotaExceeded`` (429, stream code ``QUOTA``): one tenant's
uploads, however many connections carry them, cannot take the node's memory from another's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sessioncache.quotas import refuse

__all__ = ["Charge", "InFlight"]


class InFlight:
    """Per tenant, the receive-buffer bytes held now, at most ``limit(tenant)``. Thread-safe."""

    def __init__(self, limit: Callable[[str], int]) -> None:
        self._limit = limit
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, tenant: str, nbytes: int) -> None:
        limit = self._limit(tenant)
        with self._lock:
            held = self._held.get(tenant, 0)
            if held + nbytes > limit:
                raise refuse(tenant, "inflight_bytes", held, limit, "bytes of requests in flight")
            self._held[tenant] = held + nbytes

    def remove(self, tenant: str, nbytes: int) -> None:
        with self._lock:
            left = self._held.get(tenant, 0) - nbytes
            if left > 0:
                self._held[tenant] = left
            else:
                self._held.pop(tenant, None)

    def held(self) -> dict[str, int]:
        """A snapshot: bytes in flight per tenant (tenants holding none left out)."""
        with self._lock:
            return dict(self._held)

    @contextmanager
    def charge(self, tenant: str) -> Iterator[Charge]:
        """A charge for one request's buffers, given back when the ``with`` block ends."""
        charge = Charge(self, tenant)
        try:
            yield charge
        finally:
            self.remove(tenant, charge.nbytes)


class Charge:
    """What one request holds against its tenant's bound."""

    def __init__(self, inflight: InFlight, tenant: str) -> None:
        self._inflight = inflight
        self.tenant = tenant
        self.nbytes = 0

    def __call__(self, nbytes: int) -> None:
        """Hold ``nbytes`` more (``QuotaExceeded`` past the tenant's bound)."""
        self._inflight.add(self.tenant, nbytes)
        self.nbytes += nbytes
