"""Each tenant's bounds on what the node holds for it, and what it holds now.

A shared node gives no tenant the means to starve another: every resource a request can make
the node keep for a while is counted per tenant and refused past the tenant's bound, with 429
``QuotaExceeded`` (stream code ``QUOTA``) and a message naming the bound.

``TenantLimits`` lists the bounds. Their defaults are flat settings (``tenant_upload_slots``,
``tenant_stream_connections``, ``tenant_inflight_bytes``, ``max_engines_per_tenant``,
``tenant_namespaces``, ``tenant_sessions``); ``tenant_limits`` overrides any of them for one
tenant, as JSON beside the API keys:
``{"<tenant>": {"upload_slots": 1000, "stream_connections": 4}}``. The counts themselves stay
with what they count (``UploadSlots``, the ``Tally`` objects below, the router, the
namespace owners, the session manager); ``Quotas.usage`` gathers them for ``/metrics``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import NamedTuple

from sessioncache.errors import InvalidInput, QuotaExceeded

__all__ = ["Counts", "Quotas", "Tally", "TenantLimits", "refuse"]


class TenantLimits(NamedTuple):
    """One tenant's bounds."""

    upload_slots: int
    """Open REST upload slots (``POST /v1/store`` hands one out per missing block)."""
    stream_connections: int
    """Authenticated block-stream and same-host connections at once."""
    inflight_bytes: int
    """Bytes of request bodies held in receive buffers at once (``inflight.charge``)."""
    engines: int
    """Engines registered through ``POST /v1/engines``."""
    namespaces: int
    """Namespaces (distinct roots) the tenant has used."""
    sessions: int
    """Sessions open at once."""
    pin_share: float
    """The largest share of any tier the tenant's pinned blocks (leases, sessions) may hold
    before a new lease or staging is refused."""


LIMITS = TenantLimits._fields


def refuse(tenant: str, bound: str, held: int, limit: int, what: str) -> QuotaExceeded:
    """The error for a tenant at ``bound``: it holds ``held`` of ``limit`` ``what``."""
    return QuotaExceeded(
        f"tenant {tenant!r} holds {held} {what}, its bound is {limit} "
        f"({bound}: SESSIONCACHE_TENANT_LIMITS or its default); retry once it holds fewer"
    )


class Quotas:
    """The bounds of every tenant: ``defaults``, with ``overrides`` per tenant."""

    def __init__(
        self, defaults: TenantLimits, overrides: Mapping[str, Mapping[str, float]] | None = None
    ) -> None:
        self.defaults = defaults
        self._of: dict[str, TenantLimits] = {}
        for tenant, fields in (overrides or {}).items():
            unknown = set(fields) - set(LIMITS)
            if unknown:
                raise InvalidInput(
                    f"tenant_limits[{tenant!r}]: unknown bounds {sorted(unknown)}; "
                    f"bounds are {list(LIMITS)}"
                )
            for name, value in fields.items():
                if name == "pin_share":
                    if isinstance(value, bool) or not isinstance(value, int | float):
                        raise InvalidInput(f"tenant_limits[{tenant!r}]['pin_share'] is a number")
                    if not 0 <= value <= 1:
                        raise InvalidInput(f"tenant_limits[{tenant!r}]['pin_share'] is in [0, 1]")
                elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise InvalidInput(f"tenant_limits[{tenant!r}][{name!r}] must be an int >= 0")
            self._of[tenant] = defaults._replace(**dict(fields))  # type: ignore[arg-type]
        self._counters: dict[str, Callable[[], Mapping[str, float]]] = {}
        self._tallies: dict[str, Tally] = {}

    def of(self, tenant: str) -> TenantLimits:
        return self._of.get(tenant, self.defaults)

    def count(self, bound: str, counter: Callable[[], Mapping[str, float]]) -> None:
        """Register where ``bound``'s usage per tenant is read (for ``usage``)."""
        self._counters[bound] = counter

    def tally(self, bound: str, what: str) -> Tally:
        """The node's one per-tenant count of ``bound`` (made on first use, then shared)."""
        found = self._tallies.get(bound)
        if found is None:
            found = self._tallies[bound] = Tally(self, bound, what)
            self.count(bound, found.counts)
        return found

    def usage(self) -> dict[str, dict[str, float]]:
        """Per bound, what each tenant holds now (tenants holding none left out)."""
        return {bound: dict(read()) for bound, read in self._counters.items()}


class Tally:
    """How many of something each tenant holds now, at most its ``bound``. Thread-safe."""

    def __init__(self, quotas: Quotas, bound: str, what: str) -> None:
        self._quotas = quotas
        self._bound = bound
        self._what = what
        self._held = Counts()

    def take(self, tenant: str, n: int = 1) -> None:
        """``n`` more for ``tenant``; ``QuotaExceeded`` (and nothing taken) past its bound."""
        limit = getattr(self._quotas.of(tenant), self._bound)
        if not self._held.add(tenant, n, at_most=limit):
            raise refuse(tenant, self._bound, self._held.get(tenant), limit, self._what)

    def give(self, tenant: str, n: int = 1) -> None:
        self._held.add(tenant, -n)

    def counts(self) -> dict[str, int]:
        return self._held.snapshot()


class Counts:
    """A count per tenant, tenants at zero left out. Thread-safe."""

    def __init__(self) -> None:
        self._n: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, tenant: str, n: int = 1, *, at_most: float | None = None) -> bool:
        """Add ``n`` (negative: take away); False, and nothing added, when the count would
        pass ``at_most``."""
        with self._lock:
            left = self._n.get(tenant, 0) + n
            if at_most is not None and left > at_most:
                return False
            if left > 0:
                self._n[tenant] = left
            else:
                self._n.pop(tenant, None)
            return True

    def get(self, tenant: str) -> int:
        with self._lock:
            return self._n.get(tenant, 0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._n)
