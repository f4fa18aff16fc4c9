"""Write-behind: blocks on their way to the durable tier, written by one thread in batches.

A store is acknowledged once its first tier holds the block. Its copy on the durable tier (the
disk) follows from this queue: a thread takes up to ``batch_blocks`` blocks (``batch_bytes``)
at a time and writes them with one round of syncs (``DiskTier.put_group``: group commit).
A durable store (on request, or every store with ``durable_uploads``) goes through the same
queue and waits for its blocks' tickets before it answers, so concurrent durable stores share
their syncs too.

Bounds and back-pressure: the queue holds at most ``bound_bytes``, and one tenant at most
its ``tenant_share`` of that (``quotas.TenantLimits.write_behind_share``; the tenant of a
block's namespace root, ``owner``). A store that
would pass either waits until the queue drains: one tenant's flood stalls that tenant, and a
disk slower than the stores slows the stores, never drops or lies.

Fairness: each tenant's blocks queue apart, in order, and the batches take tenants in turn,
about one batch slot (``batch_bytes / batch_blocks``) each: deficit round robin
(``store.fair``). A batch holding a durable store's blocks ends after the last of them (an
eighth of a batch at least), so a durable store waits for the batch being written, its own
tenant's earlier blocks, and about one slot of each other busy tenant per block of its
tenant's: never for another tenant's backlog. ``waited_behind`` says, per tenant, the most
bytes of other tenants' blocks one of its durable stores waited for.

What a crash loses: a block acknowledged as not durable is lost only if it was still queued
(at most ``bound_bytes``); a durable one never (its answer waited for the sync).

The thread lets a burst of stores finish before it writes: it starts once the stores have
paused for ``IDLE_S`` (50 ms), or the backlog passes half its bound, or a durable store waits,
or a store waits for room in a full tier (``hurry``: then it writes on until the queue is
empty, the tier's room coming from its copies).
A busy node thus copies its stores first and writes them to disk right after, rather than
making both compete for the same cores.

A block whose copy fails for want of room (a full filesystem with nothing the tier may evict)
stays in memory: no eviction drops it (``StoreCore._evict``: a victim that cannot be demoted
stays, and the store that needed the room is refused), and the thread offers it again every
``RETRY_S`` while the queue is idle and the durable tier has room for it: what was written
behind drains once space returns. ``write_behind_failed`` counts each such block once.

A queued block is not pinned: if its tier evicts it first, the eviction demotes it to the
disk (a copy the queue then finds done). While the thread copies a block it holds it in
flight (``StoreCore.flush_begin``), so its slot is not reused under the copy; a store that
finds nothing else to evict in a full tier waits for that copy to end (``StoreCore.make_room``:
back-pressure, as a full queue's), rather than being answered ``dropped``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from sessioncache.errors import TierFull
from sessioncache.hashing import BlockHash
from sessioncache.quotas import Counts
from sessioncache.store.blocks import BlockMeta
from sessioncache.store.core import StoreCore
from sessioncache.store.fair import FairBatches
from sessioncache.store.results import Ticket
from sessioncache.tiers.base import GroupCommitTier, PutItem

log = logging.getLogger("sessioncache.store.behind")

DEFAULT_BOUND_BYTES = 4 << 30
DEFAULT_TENANT_SHARE = 0.5
DEFAULT_BATCH_BLOCKS = 64
DEFAULT_BATCH_BYTES = 64 << 20
IDLE_S = 0.05
DEGRADED_SHARE = 0.8
DEGRADED_AFTER_S = 10.0
RETRY_S = 1.0


def _one_tenant(root: bytes) -> str:
    return ""


def _default_share(tenant: str) -> float:
    return DEFAULT_TENANT_SHARE


@dataclass(slots=True)
class _Queued:
    meta: BlockMeta
    ticket: Ticket


class WriteBehind:
    """The write-behind queue of a store with a durable tier (module docstring)."""

    def __init__(
        self,
        core: StoreCore,
        durable: int,
        *,
        bound_bytes: int = DEFAULT_BOUND_BYTES,
        owner: Callable[[bytes], str] | None = None,
        tenant_share: Callable[[str], float] | None = None,
        batch_blocks: int = DEFAULT_BATCH_BLOCKS,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
    ) -> None:
        """``owner``: the tenant of a namespace root, whose share a block counts in (None:
        every block is one tenant's, ``""``); ``tenant_share``: a tenant's share of
        ``bound_bytes``, in (0, 1] (None: ``DEFAULT_TENANT_SHARE`` each)."""
        self._core = core
        self.durable: Final = durable
        """The index of the durable tier."""
        self.bound_bytes = bound_bytes
        self.owner: Callable[[bytes], str] = owner or _one_tenant
        """The tenant of a namespace root: whose share a block counts in."""
        self._share = tenant_share or _default_share
        self._cond = threading.Condition()
        self._queue: FairBatches[_Queued] = FairBatches(batch_blocks, batch_bytes)
        self._bytes = 0
        self._queued: dict[BlockHash, int] = {}  # the ids queued, not written yet (a count each)
        self.tenants = Counts()
        """Bytes queued per tenant."""
        self._closed = False
        self._urgent = 0  # durable blocks queued: written at once
        self._hurried = False  # a store waited for room: write until the queue is empty
        self._last_submit = 0.0
        self._above_since: float | None = None
        self.written = 0
        self.failed = 0
        self._taken = 0  # bytes of the blocks taken out of the queue, written or not
        self._taken_of: dict[str, int] = {}  # the same, per tenant
        self._waited: dict[str, int] = {}  # (condition) ``waited_behind``
        self._unwritten: dict[BlockHash, BlockMeta] = {}
        """(condition) Blocks whose copies failed for want of room, held above only."""
        self._batch_bytes = batch_bytes
        self._retry_at = 0.0
        self._thread = threading.Thread(
            target=self._run, name="sessioncache-write-behind", daemon=True
        )
        self._thread.start()

    # -- the stores' side ------------------------------------------------------------------

    @property
    def backlog_bytes(self) -> int:
        """Bytes queued or being written."""
        with self._cond:
            return self._bytes

    def degraded(self) -> bool:
        """Whether the backlog has stayed above 80% of its bound for 10 s."""
        with self._cond:
            since = self._above_since
        return since is not None and time.monotonic() - since >= DEGRADED_AFTER_S

    def submit(self, meta: BlockMeta, *, durable: bool = False) -> Ticket:
        """Queue a block held in a tier above the durable one, once there is room for it (it
        waits: back-pressure); a ``durable`` one (its store waits for it) is written at once.
        Call without the store's lock."""
        tenant = self.owner(meta.namespace_root)
        ticket = Ticket(meta.nbytes, tenant, urgent=durable)
        with self._cond:
            while not self._closed and self._full(tenant, meta.nbytes):
                self._cond.wait()
            if self._closed:
                ticket.done.set()
                return ticket
            if durable:
                ticket.others_before = self._taken - self._taken_of.get(tenant, 0)
            self._queue.push(tenant, _Queued(meta, ticket), meta.nbytes, urgent=durable)
            self._queued[meta.block_hash] = self._queued.get(meta.block_hash, 0) + 1
            self._urgent += durable
            self._last_submit = time.monotonic()
            self._bytes += meta.nbytes
            self.tenants.add(tenant, meta.nbytes)
            self._note_level()
            self._cond.notify_all()
        return ticket

    def submit_many(self, metas: Sequence[BlockMeta], *, durable: bool = False) -> list[Ticket]:
        """``submit`` of each of ``metas`` in order (each waits for room as ``submit`` does),
        taking the queue's lock once while there is room. Without ``durable`` no store waits
        for them: their tickets share one event, and none is returned."""
        owners: dict[bytes, str] = {}
        tickets: list[Ticket] = []
        shared = None if durable else threading.Event()
        with self._cond:
            for meta in metas:
                root, nbytes = meta.namespace_root, meta.nbytes
                tenant = owners.get(root)
                if tenant is None:
                    tenant = owners[root] = self.owner(root)
                ticket = (
                    Ticket(nbytes, tenant, urgent=True)
                    if shared is None
                    else Ticket(nbytes, tenant, done=shared)
                )
                if durable:
                    tickets.append(ticket)
                while not self._closed and self._full(tenant, nbytes):
                    self._cond.notify_all()  # what is queued so far may be written meanwhile
                    self._cond.wait()
                if self._closed:
                    ticket.done.set()
                    continue
                if durable:
                    ticket.others_before = self._taken - self._taken_of.get(tenant, 0)
                self._queue.push(tenant, _Queued(meta, ticket), nbytes, urgent=durable)
                self._queued[meta.block_hash] = self._queued.get(meta.block_hash, 0) + 1
                self._urgent += durable
                self._bytes += nbytes
                self.tenants.add(tenant, nbytes)
            self._last_submit = time.monotonic()
            self._note_level()
            self._cond.notify_all()
        return tickets

    def _full(self, tenant: str, nbytes: int) -> bool:
        """(condition held) Whether ``nbytes`` more of ``tenant``'s would pass a bound."""
        if self._bytes and self._bytes + nbytes > self.bound_bytes:
            return True
        queued = self.tenants.get(tenant)
        return bool(queued) and queued + nbytes > self.tenant_bytes(tenant)

    def tenant_bytes(self, tenant: str) -> int:
        """The most bytes ``tenant``'s blocks may hold in the queue: its share of the bound
        (at least one byte: a tenant's first block always enters an empty share)."""
        return max(1, int(self.bound_bytes * self._share(tenant)))

    def waited_behind(self) -> dict[str, int]:
        """Per tenant, the most bytes of other tenants' blocks the queue took out (wrote, or
        found settled) between the submission of one of its durable stores' blocks and the
        end of that block's batch: the batch under way, and the others' slots of its own."""
        with self._cond:
            return dict(self._waited)

    def queued(self, block_hash: BlockHash) -> bool:
        """Whether ``block_hash`` waits in the queue or in the batch being written."""
        return block_hash in self._queued

    def hurry(self) -> None:
        """A store waits for room in a tier that copies of queued blocks would make: write
        now, and on until the queue is empty, without waiting for the stores to pause."""
        with self._cond:
            if not self._hurried:
                self._hurried = True
                self._cond.notify_all()

    @staticmethod
    def wait(tickets: Sequence[Ticket]) -> bool:
        """Wait for ``tickets``; whether every block reached the durable tier."""
        for ticket in tickets:
            ticket.done.wait()
        return all(t.ok for t in tickets)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until the queue is empty (what is queued now and later); False on timeout.
        The thread writes at once meanwhile (``hurry``): someone waits."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            self._retry()  # and what could not be written so far, where it fits now
            if self._bytes and not self._hurried:
                self._hurried = True
                self._cond.notify_all()
            while self._bytes:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued (within ``timeout_s``), then stop the thread."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            left = len(self._unwritten)
        if left:
            log.warning("write-behind: %d blocks held in memory only could not be written", left)
        self._thread.join(timeout_s)

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    if not self._queue:
                        self._hurried = False
                        if not self._unwritten:
                            self._cond.wait()
                        elif (left := self._retry_at - time.monotonic()) > 0:
                            self._cond.wait(left)
                        else:
                            self._retry()
                        continue
                    idle = time.monotonic() - self._last_submit
                    if self._urgent or self._hurried or self._bytes > self.bound_bytes / 2:
                        break
                    if idle >= IDLE_S:
                        break
                    self._cond.wait(IDLE_S - idle)  # a burst under way: let it finish
                if not self._queue:
                    return
                batch = self._queue.take()
            try:
                self._write(batch)
            except Exception:
                log.exception("write-behind: a batch of %d blocks failed", len(batch))
            finally:
                with self._cond:
                    for queued in batch:
                        block_hash = queued.meta.block_hash
                        left = self._queued.pop(block_hash, 1) - 1
                        if left:
                            self._queued[block_hash] = left
                        t = queued.ticket
                        self._urgent -= t.urgent
                        self._bytes -= t.nbytes
                        self.tenants.add(t.tenant, -t.nbytes)
                        self._taken += t.nbytes
                        self._taken_of[t.tenant] = self._taken_of.get(t.tenant, 0) + t.nbytes
                    for queued in batch:
                        t = queued.ticket
                        if t.urgent:
                            others = self._taken - self._taken_of[t.tenant] - t.others_before
                            self._waited[t.tenant] = max(self._waited.get(t.tenant, 0), others)
                        t.done.set()
                    self._note_level()
                    self._cond.notify_all()

    def _retry(self) -> None:
        """(condition held) Queue again the blocks whose copies failed (a batch at most; the
        write makes room as for any batch); next try in ``RETRY_S``. Records of blocks gone
        meanwhile, or on the durable tier already, are dropped."""
        self._retry_at = time.monotonic() + RETRY_S
        size = 0
        for block_hash, meta in list(self._unwritten.items()):
            if not meta.live or self.durable in meta.tiers:
                del self._unwritten[block_hash]
                continue
            if block_hash in self._queued:
                continue
            if size + meta.nbytes > self._batch_bytes:
                break
            size += meta.nbytes
            tenant = self.owner(meta.namespace_root)
            self._queue.push(tenant, _Queued(meta, Ticket(meta.nbytes, tenant)), meta.nbytes)
            self._queued[meta.block_hash] = self._queued.get(meta.block_hash, 0) + 1
            self._bytes += meta.nbytes
            self.tenants.add(tenant, meta.nbytes)

    def _write(self, batch: list[_Queued]) -> None:
        """Copy a batch's blocks to the durable tier with one round of syncs."""
        core, d = self._core, self.durable
        tier = core.tiers[d]
        todo: list[tuple[_Queued, BlockMeta]] = []
        held: list[tuple[BlockMeta, tuple[int, ...]]] = []
        settled: list[BlockHash] = []  # no longer to be written
        failed: list[BlockMeta] = []  # could not be written for want of room
        with core.lock:
            for queued in batch:
                meta = core.index.get(queued.meta.block_hash)
                if meta is None or not meta.tiers or d in meta.tiers:
                    settled.append(queued.meta.block_hash)
                if meta is None or not meta.tiers:
                    continue  # dropped or expired meanwhile: nothing to keep
                if d in meta.tiers:
                    queued.ticket.ok = True  # there already (an eviction demoted it)
                    continue
                # in flight: its slot is not reused under the copy
                held.append((meta, core.flush_begin(meta, d)))
                todo.append((queued, meta))
        try:
            items: list[PutItem] = []
            kept: list[tuple[_Queued, BlockMeta]] = []
            for queued, meta in todo:
                data = core.tiers[min(meta.tiers)].get(meta.block_hash)
                if data is None:
                    continue
                items.append(
                    PutItem(
                        meta.block_hash,
                        data,
                        meta.namespace_root,
                        meta.parent,
                        meta.expires_at,
                        meta.checksum,  # known for same-host commits: no second hash
                    )
                )
                kept.append((queued, meta))
            # room for as much of the batch as the tier could hold, evicting there: never
            # more (a filesystem full of other files would empty the tier for nothing)
            room, need = core.room_of(d), 0
            for _, meta in kept:
                if need + meta.nbytes > room:
                    break
                need += meta.nbytes
            while need and not tier.fits(need):
                if not core.evict_one(d, kept[0][1]):
                    break
            if isinstance(tier, GroupCommitTier):
                errors: list[Exception | None] = tier.put_group(items)
            else:
                errors = [TierFull("no group commit") for _ in items]
            for k, (queued, meta) in enumerate(kept):
                error = errors[k]
                if isinstance(error, TierFull):
                    # the room went to another writer, or the tier commits one by one: alone
                    ok = core.place(meta, items[k].payload, d, stop=d + 1, wait=False) is not None
                    if not ok and meta.live:
                        failed.append(meta)  # held above: written once there is room
                        continue
                elif error is None:
                    with core.lock:
                        if meta.live:
                            core.add_to_tier(meta, d)
                            ok = True
                        else:
                            tier.delete(meta.block_hash)
                            ok = False
                else:
                    log.warning("write-behind: block %s: %s", meta.block_hash.hex(), error)
                    ok = False
                queued.ticket.ok = ok
                if ok:
                    self.written += 1
                    settled.append(meta.block_hash)
                else:
                    self.failed += 1
        finally:
            core.flush_end(held)
            with self._cond:
                for block_hash in settled:
                    self._unwritten.pop(block_hash, None)
                for meta in failed:
                    if meta.block_hash not in self._unwritten:
                        self.failed += 1  # once per block, however often it is retried
                        self._unwritten[meta.block_hash] = meta
                if failed:
                    self._retry_at = time.monotonic() + RETRY_S

    def _note_level(self) -> None:
        """(condition held) Track how long the backlog has stayed above 80% of its bound."""
        if self._bytes > DEGRADED_SHARE * self.bound_bytes:
            if self._above_since is None:
                self._above_since = time.monotonic()
        else:
            self._above_since = None
