"""Each tenant's bounds on what the node holds for it, and the admission of every grant of them.

A shared node gives no tenant the means to starve another: every resource a request can make
the node keep for a while is admitted here, with its size, before it is granted, and refused
past the tenant's bound with 429 ``QuotaExceeded`` (stream code ``QUOTA``) and a message naming
the bound.

``TenantLimits`` lists the bounds. Their defaults are flat settings (``tenant_upload_slots``,
``tenant_stream_connections``, ``tenant_inflight_bytes``, ``max_engines_per_tenant``,
``tenant_namespaces``, ``tenant_sessions``, ``tenant_pin_share``,
``tenant_write_behind_share``); ``tenant_limits`` overrides any of them for one tenant, as JSON
beside the API keys: ``{"<tenant>": {"upload_slots": 1000, "stream_connections": 4}}``.

Two kinds of grant:

* a count (``Quotas.admit``): a connection, a session, a namespace, bytes in flight. The node's
  own tallies (``Quotas.tally``) are counted here; the namespace owners and the session manager
  keep their own counts, read and granted under a lock of their own, and admit through it too
  (``UploadSlots`` and the router, which first make room of their own, check their bound and
  ``refuse`` alike);
* pinned bytes (``PinBudget``): a lease (of every carrier), a session's pin, a same-host
  staging. Its amount is the bytes per tier it would pin, admitted against the tenant's
  ``pin_share`` of each tier together with what it pins already, under the store's lock, with
  the grant itself: a lease or a pin takes the prefix of its blocks that fits.

The parts that hold what they count take their admission at construction (``admitter``,
``write_behind_share``; the node's pins, ``node.TenantPins``), so every bound is in force from
the first request.

``Quotas.usage`` gathers the counts for ``/metrics``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from sessioncache.errors import InvalidInput, QuotaExceeded

__all__ = ["Counts", "PinBudget", "Quotas", "Sizes", "Tally", "TenantLimits", "refuse"]


class TenantLimits(NamedTuple):
    """One tenant's bounds."""

    upload_slots: int
    """Open REST upload slots (``POST /v1/store`` hands one out per missing block)."""
    stream_connections: int
    """Authenticated block-stream and same-host connections at once."""
    http_connections: int
    """REST connections at once, counted from their first request head (``api.connections``;
    by default ``http_tenant_share`` of the node's connection cap)."""
    inflight_bytes: int
    """Bytes of request bodies held in receive buffers at once (``inflight.charge``)."""
    engines: int
    """Engines registered through ``POST /v1/engines``."""
    namespaces: int
    """Namespaces (distinct roots) the tenant has used."""
    sessions: int
    """Sessions open at once."""
    pin_share: float
    """The largest share of each tier the tenant's pinned blocks (leases, session pins) and
    same-host stagings may hold together (``PinBudget``)."""
    write_behind_share: float
    """The largest share of the write-behind queue's bound (``write_behind_bytes``) the
    tenant's blocks may take while they wait for the disk (``store.behind``): past it the
    tenant's stores wait, never another tenant's."""


LIMITS = TenantLimits._fields
SHARES = ("pin_share", "write_behind_share")
"""The bounds that are a share (a number in [0, 1]) rather than a count."""

UNITS: Mapping[str, str] = {
    "upload_slots": "upload slots open",
    "stream_connections": "data-plane connections",
    "http_connections": "REST connections",
    "inflight_bytes": "bytes of requests in flight",
    "engines": "engines registered",
    "namespaces": "namespaces",
    "sessions": "open sessions",
}
"""What each count bound counts, for its refusal."""


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
                if name in SHARES:
                    if isinstance(value, bool) or not isinstance(value, int | float):
                        raise InvalidInput(f"tenant_limits[{tenant!r}][{name!r}] is a number")
                    empty = name == "pin_share"  # no pins at all; a queue share is > 0
                    if not (0 <= value <= 1 and (empty or value > 0)):
                        interval = "[0, 1]" if empty else "(0, 1]"
                        raise InvalidInput(f"tenant_limits[{tenant!r}][{name!r}] is in {interval}")
                elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise InvalidInput(f"tenant_limits[{tenant!r}][{name!r}] must be an int >= 0")
            self._of[tenant] = defaults._replace(**dict(fields))  # type: ignore[arg-type]
        self._counters: dict[str, Callable[[], Mapping[str, float]]] = {}
        self._tallies: dict[str, Counts] = {}
        self._lock = threading.Lock()

    def of(self, tenant: str) -> TenantLimits:
        return self._of.get(tenant, self.defaults)

    def admitter(self, bound: str) -> Callable[[str, int], None]:
        """``admit`` of one more of the count ``bound`` to a tenant holding so many, for a
        part that keeps its own count (``NamespaceOwners``, ``SessionManager``)."""
        if bound not in UNITS:
            raise ValueError(f"{bound!r} is not a count bound")

        def admit(tenant: str, held: int) -> None:
            self.admit(tenant, bound, held=held)

        return admit

    def write_behind_share(self, tenant: str) -> float:
        """The tenant's share of the write-behind queue (``TenantLimits.write_behind_share``)."""
        return self.of(tenant).write_behind_share

    def count(self, bound: str, counter: Callable[[], Mapping[str, float]]) -> None:
        """Register where ``bound``'s usage per tenant is read (for ``usage``)."""
        self._counters[bound] = counter

    def tally(self, bound: str) -> Tally:
        """The node's one count of ``bound`` per tenant (made on first use, then shared), as
        a handle to ``admit`` and ``release`` it by."""
        return Tally(self, bound)

    def admit(self, tenant: str, bound: str, amount: int = 1, *, held: int | None = None) -> None:
        """Admit a grant of ``amount`` more of the count ``bound`` to ``tenant``, before it is
        made: ``QuotaExceeded`` naming the bound, and nothing granted, past the tenant's bound.

        ``held``: what the tenant holds now, for a count kept by what it counts (which reads
        it and grants under one lock of its own). Without it, the count is the node's tally of
        ``bound``, taken here with the check (``release`` gives it back)."""
        limit = getattr(self.of(tenant), bound)
        if held is None:
            tallied = self._tallied(bound)
            if tallied.add(tenant, amount, at_most=limit):
                return
            held = tallied.get(tenant)
        elif held + amount <= limit:
            return
        raise refuse(tenant, bound, held, limit, f"{UNITS[bound]} and asks {amount} more")

    def release(self, tenant: str, bound: str, amount: int = 1) -> None:
        """Give back ``amount`` of the tally of ``bound`` that ``admit`` took for ``tenant``."""
        self._tallied(bound).add(tenant, -amount)

    def pins(
        self,
        tenant: str,
        roots: Sequence[bytes],
        *,
        staged: Counts | None = None,
        staged_tier: int | None = None,
        into: int | None = None,
    ) -> PinBudget:
        """The budget a grant of pinned bytes to ``tenant`` is admitted against (``PinBudget``):
        its ``pin_share``, its namespace ``roots``, ``staged`` (its same-host staging, held in
        ``staged_tier``) and ``into`` (the tier a locate copies the granted blocks into)."""
        return PinBudget(tenant, self.of(tenant).pin_share, roots, staged, staged_tier, into)

    def usage(self) -> dict[str, dict[str, float]]:
        """Per bound, what each tenant holds now (tenants holding none left out)."""
        return {bound: dict(read()) for bound, read in self._counters.items()}

    def _tallied(self, bound: str) -> Counts:
        found = self._tallies.get(bound)  # made once: later admits take no lock of ours
        if found is not None:
            return found
        with self._lock:
            found = self._tallies.get(bound)
            if found is None:
                found = self._tallies[bound] = Counts()
                self.count(bound, found.snapshot)
            return found


class Tally(NamedTuple):
    """One of the node's tallied count bounds, by handle (``Quotas.tally``)."""

    quotas: Quotas
    bound: str

    def admit(self, tenant: str, n: int = 1) -> None:
        """``n`` more for ``tenant``; ``QuotaExceeded`` (and nothing taken) past its bound."""
        self.quotas.admit(tenant, self.bound, n)

    def release(self, tenant: str, n: int = 1) -> None:
        self.quotas.release(tenant, self.bound, n)

    @contextmanager
    def charge(self, tenant: str) -> Iterator[Charge]:
        """A charge for one request's receive buffers (the node's ``inflight_bytes``): the
        request charges its tenant as its buffers grow with the bytes it has received (never
        for what it only declares: ``buffers.Filling``), past the tenant's bound
        ``QuotaExceeded``; given back when the ``with`` block ends. One tenant's uploads,
        however many connections carry them, cannot take the node's memory from another's."""
        held = Charge(self, tenant)
        try:
            yield held
        finally:
            self.release(tenant, held.nbytes)


class Charge:
    """What one request holds against its tenant's bound (``Tally.charge``)."""

    def __init__(self, tally: Tally, tenant: str) -> None:
        self._tally = tally
        self.tenant = tenant
        self.nbytes = 0

    def __call__(self, nbytes: int) -> None:
        """Hold ``nbytes`` more (``QuotaExceeded`` past the tenant's bound)."""
        self._tally.admit(self.tenant, nbytes)
        self.nbytes += nbytes


Sizes = npt.NDArray[np.int64]
"""Bytes per block (rows, in grant order) and tier (columns)."""


class PinBudget(NamedTuple):
    """Room for one tenant's lasting pins (leases, session pins) in each tier: its ``share``
    of the tier's capacity, less what it pins already (the blocks under its namespace
    ``roots``, pinned by anything, moves in flight too) and its same-host ``staged`` bytes.

    A store admits a grant against it under the store's lock, with the grant itself, so two
    grants of one tenant never both spend the same room: ``admit`` says how many of the
    grant's blocks, from the first, fit, by the bytes each would add (nothing for a block a
    lease or a session pin holds already; ``index.pin_sizes``)."""

    tenant: str
    share: float
    roots: Sequence[bytes]
    staged: Counts | None = None
    staged_tier: int | None = None
    into: int | None = None
    """The tier a locate copies the granted blocks into (they will be pinned there too)."""

    def room(self, pinned: Mapping[bytes, Sequence[int]], capacity: Sequence[int]) -> Sizes:
        """Per tier, the bytes the tenant may still pin (negative: it is over its share);
        ``pinned``: the store's pinned bytes per root and tier (read under its lock)."""
        held = np.zeros(len(capacity), np.int64)
        for root in self.roots:
            per_tier = pinned.get(root)
            if per_tier is not None:
                held += per_tier
        if self.staged is not None and self.staged_tier is not None:
            held[self.staged_tier] += self.staged.get(self.tenant)
        share = np.floor(self.share * np.asarray(capacity, np.float64)).astype(np.int64)
        return share - held

    def admit(self, sizes: Sizes, room: Sizes) -> int:
        """How many of a grant's blocks, from the first, fit in ``room``: ``sizes``, the bytes
        each adds per tier (rows in grant order), summed from the first, stay within the room
        of every tier they add to."""
        if not len(sizes):
            return 0
        over = ((np.cumsum(sizes, axis=0) > room) & (sizes > 0)).any(axis=1)
        return int(over.argmax()) if over.any() else len(sizes)

    def refuse(
        self, first: Sizes, room: Sizes, names: Sequence[str], capacity: Sequence[int]
    ) -> QuotaExceeded:
        """The error for a grant of which not even the ``first`` block fits."""
        tier = int(np.argmax((first > 0) & (first > room)))
        return QuotaExceeded(
            f"tenant {self.tenant!r} may pin {self.share} of the {names[tier]} tier "
            f"({capacity[tier]} bytes) and has {max(int(room[tier]), 0)} of them left, too "
            f"few for {int(first[tier])} more (pin_share: "
            "SESSIONCACHE_TENANT_LIMITS or SESSIONCACHE_TENANT_PIN_SHARE): release leases or "
            "close sessions first"
        )


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
