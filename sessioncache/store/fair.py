"""Fair turns across tenants: the write-behind queue's order (``FairBatches``), per-tenant
queues cut into batches by deficit round robin, the line of stores waiting for room in a
tier (``TenantLine``), tenant by tenant, and bounded queues served one item a turn
(``TenantTurns``: the prefetch engine's moves).

``FairBatches``: each tenant's items stay in the order they were queued (a chain's parents
before its children, and a durable store after what its tenant queued before it). Tenants with
items queued take turns: a turn serves items while their cost fits the tenant's deficit, which
each turn raises by a quantum of one batch slot (``batch_bytes / batch_items``). An item costs
its bytes, at least one slot (a small block's write costs about as much as a slot's: its file,
its sync), so a turn is about one item of up to a slot, and a larger item waits for as many
turns as it has slots. A tenant whose queue empties leaves the round and forgets its deficit.

Batches are cut from that order, never reordered: the next items up to ``batch_items`` and
``batch_bytes``, but when they hold items someone waits for (``urgent``: a durable store's
blocks), only up to the last of those, or to an eighth of ``batch_items`` if that is further.
A waiter's batch is thus short (waiters of every tenant still share it), while a tenant making
one small durable store after another still leaves the others most of each round (a round
costs a sync of every block in it, and a fixed part besides). A waiter waits for the batch
being written, then for its own tenant's items queued before it, each of them and itself
after about one slot of each other busy tenant, whatever those tenants' backlogs.

Sans IO: no threads, no clock; the caller locks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")


class _Entry(NamedTuple, Generic[T]):
    item: T
    nbytes: int
    urgent: bool


@dataclass(slots=True)
class _Round:
    """Where the round robin stands: the tenants with items queued in turn order (the first
    one's turn is under way once ``begun``), and each one's deficit."""

    ring: deque[str] = field(default_factory=deque)
    deficit: dict[str, int] = field(default_factory=dict)
    begun: bool = False

    def copy(self) -> _Round:
        return _Round(deque(self.ring), dict(self.deficit), self.begun)


class FairBatches(Generic[T]):
    """Items queued per tenant, taken in batches fair across tenants (module docstring)."""

    def __init__(self, batch_items: int, batch_bytes: int) -> None:
        if batch_items < 1 or batch_bytes < 1:
            raise ValueError("batch_items and batch_bytes must be at least 1")
        self._batch_items = batch_items
        self._batch_bytes = batch_bytes
        self._quantum = max(1, batch_bytes // batch_items)
        self._least_items = max(1, batch_items // 8)
        self._lanes: dict[str, deque[_Entry[T]]] = {}
        self._round = _Round()
        self._count = 0

    def __len__(self) -> int:
        """How many items are queued."""
        return self._count

    def push(self, tenant: str, item: T, nbytes: int, *, urgent: bool = False) -> None:
        """Queue ``item`` (``nbytes`` long) after ``tenant``'s others."""
        lane = self._lanes.get(tenant)
        if lane is None:
            lane = self._lanes[tenant] = deque()
            self._round.ring.append(tenant)
            self._round.deficit[tenant] = 0
        lane.append(_Entry(item, nbytes, urgent))
        self._count += 1

    def take(self) -> list[T]:
        """The next batch (empty when nothing is queued)."""
        count = size = cut = 0
        for entry in self._order(self._round.copy()):
            if count == self._batch_items or (count and size + entry.nbytes > self._batch_bytes):
                break
            count += 1
            size += entry.nbytes
            if entry.urgent:
                cut = count
        if cut:
            count = min(count, max(cut, self._least_items))
        taken = self._order(self._round, take=True)
        return [next(taken).item for _ in range(count)]

    def _order(self, at: _Round, *, take: bool = False) -> Iterator[_Entry[T]]:
        """The queued items in the order the round robin serves them from ``at`` (advanced as
        they are served); ``take``: each served item leaves its queue."""
        served: dict[str, int] = {}  # per tenant: items the look-ahead passed
        while at.ring:
            tenant = at.ring[0]
            lane = self._lanes[tenant]
            entry = lane[served.get(tenant, 0)]
            if not at.begun:
                at.deficit[tenant] += self._quantum
                at.begun = True
            cost = max(entry.nbytes, self._quantum)
            if cost > at.deficit[tenant]:  # its turn is over: the next tenant's begins
                at.ring.rotate(-1)
                at.begun = False
                continue
            at.deficit[tenant] -= cost
            if take:
                lane.popleft()
                self._count -= 1
            else:
                served[tenant] = served.get(tenant, 0) + 1
            if served.get(tenant, 0) == len(lane):  # it leaves the round
                at.ring.popleft()
                del at.deficit[tenant]
                at.begun = False
                if take:
                    del self._lanes[tenant]
            yield entry


class _TenantQueues(Generic[T]):
    """A queue per tenant and the tenants in turn (the first one's head goes next): what
    ``TenantLine`` and ``TenantTurns`` keep."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[T]] = {}
        self._turns: deque[str] = deque()

    def _enqueue(self, tenant: str, item: T) -> None:
        """``item`` at the end of ``tenant``'s queue; a tenant new to the line goes last."""
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = deque()
            self._turns.append(tenant)
        queue.append(item)

    def _drop(self, tenant: str) -> None:
        """``tenant``'s queue, empty now, leaves the line."""
        del self._queues[tenant]
        self._turns.remove(tenant)


class TenantLine(_TenantQueues[object]):
    """Waiters in one line, fair across tenants: a queue per tenant, the tenants in turn (the
    head of the first tenant's queue goes next; once it was served, that tenant goes last):
    the stores waiting for room in one tier (``StoreCore.make_room``)."""

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def join(self, tenant: str, waiter: object) -> None:
        self._enqueue(tenant, waiter)

    def head(self) -> object | None:
        return self._queues[self._turns[0]][0] if self._turns else None

    def leave(self, tenant: str, waiter: object, served: bool) -> None:
        queue = self._queues[tenant]
        queue.remove(waiter)
        if not queue:
            self._drop(tenant)
        elif served and self._turns[0] == tenant:
            self._turns.rotate(-1)


class TenantTurns(_TenantQueues[T]):
    """A queue per tenant, bounded per tenant (``per_tenant``) and in all (``total``), served
    one item a turn, the tenants in turn."""

    def __init__(self, per_tenant: int, total: int) -> None:
        super().__init__()
        self.per_tenant = per_tenant
        self.total = total
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def full(self, tenant: str) -> bool:
        """Whether a ``push`` for ``tenant`` would pass a bound."""
        queue = self._queues.get(tenant)
        return self._count >= self.total or (queue is not None and len(queue) >= self.per_tenant)

    def push(self, tenant: str, item: T) -> None:
        """Queue ``item`` (the caller checked ``full``)."""
        self._enqueue(tenant, item)
        self._count += 1

    def pop(self) -> T | None:
        """The next item: the head of the first tenant's queue, that tenant then last."""
        if not self._turns:
            return None
        tenant = self._turns[0]
        queue = self._queues[tenant]
        item = queue.popleft()
        self._count -= 1
        if queue:
            self._turns.rotate(-1)
        else:
            self._drop(tenant)
        return item

    def clear(self) -> list[T]:
        """Every queued item, removed."""
        items = [item for queue in self._queues.values() for item in queue]
        self._queues.clear()
        self._turns.clear()
        self._count = 0
        return items
