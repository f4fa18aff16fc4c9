"""Bytes each tenant's requests hold in receive buffers now, bounded per tenant.

A request charges its tenant as its buffers grow with the bytes it has received (never for
what it only declares: ``buffers.Filling``) and gives the charge back when it ends. A charge
past the tenant's bound (``inflight_bytes``) raises ``QuotaExceeded`` (429, stream code
``QUOTA``): one tenant's uploads, however many connections carry them, cannot take the node's
memory from another's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sessioncache.quotas import Tally

__all__ = ["Charge", "charge"]


@contextmanager
def charge(tally: Tally, tenant: str) -> Iterator[Charge]:
    """A charge for one request's buffers against ``tally`` (the node's ``inflight_bytes``),
    given back when the ``with`` block ends."""
    held = Charge(tally, tenant)
    try:
        yield held
    finally:
        tally.release(tenant, held.nbytes)


class Charge:
    """What one request holds against its tenant's bound."""

    def __init__(self, tally: Tally, tenant: str) -> None:
        self._tally = tally
        self.tenant = tenant
        self.nbytes = 0

    def __call__(self, nbytes: int) -> None:
        """Hold ``nbytes`` more (``QuotaExceeded`` past the tenant's bound)."""
        self._tally.admit(self.tenant, nbytes)
        self.nbytes += nbytes
