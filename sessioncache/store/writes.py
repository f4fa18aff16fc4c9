"""The store's one write path: ``prepare`` a write, then ``fill`` its blocks from payloads or
``reserve`` shared-memory slots that ``commit`` publishes (``abort`` frees them); ``put`` and
``stage`` are the two in one call. Deletion and the expiry sweep."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

from sessioncache.errors import (
    DurableStoreFailed,
    InvalidInput,
    PayloadSizeError,
    TierFull,
)
from sessioncache.hashing import BlockHash, payload_checksum
from sessioncache.status import BlockStatus
from sessioncache.store.blocks import BlockMeta
from sessioncache.store.core import StorePart
from sessioncache.store.results import (
    _PLACE_ATTEMPTS,
    Sync,
    Write,
    WriteResult,
    check_ttl,
)
from sessioncache.tiers.base import (
    StagedSlot,
)
from sessioncache.tiers.payload import Payload, as_memoryview, payload_nbytes


class StoreWrites(StorePart):
    """The store's one write path (``TieredStore.writes``), deletion and the expiry sweep."""

    def put(
        self,
        hashes: Sequence[BlockHash],
        payloads: Sequence[Payload],
        *,
        namespace_root: bytes,
        parent: BlockHash | None = None,
        ttl_s: float | None = None,
        tier: str | None = None,
        durable: bool = False,
        next_use: float | None = None,
    ) -> WriteResult:
        """Store a chain segment: ``hashes[0]``'s parent is ``parent`` (None at a chain root).
        ``prepare`` and ``fill`` of each block in order (after a block that is not held, the
        rest is dropped: see ``fill``).

        Every payload of one namespace must have the same size; a mismatch raises
        ``PayloadSizeError`` before anything is written."""
        if len(hashes) != len(payloads):
            raise InvalidInput(f"{len(hashes)} ids but {len(payloads)} payloads")
        self._core.check_ids(hashes, namespace_root, parent)
        sizes = [payload_nbytes(p) for p in payloads]
        for block_hash, nbytes in zip(hashes, sizes, strict=True):
            if nbytes != sizes[0]:
                raise PayloadSizeError(
                    f"block {block_hash.hex()}: payload is {nbytes} bytes, but blocks of this "
                    f"namespace are {sizes[0]} bytes"
                )
        write = self.prepare(
            hashes,
            namespace_root=namespace_root,
            nbytes=sizes[0] if sizes else 1,
            parents=[parent, *hashes[:-1]][: len(hashes)],
            ttl_s=ttl_s,
            tier=tier,
            durable=durable,
            next_use=next_use,
        )
        for i, payload in enumerate(payloads):
            self.fill(write, i, payload)
        self.settle(write)
        return WriteResult(write.hashes, [s or BlockStatus.DROPPED for s in write.status])

    def prepare(
        self,
        hashes: Sequence[BlockHash],
        *,
        namespace_root: bytes,
        nbytes: int | None,
        parents: Sequence[BlockHash | None],
        ttl_s: float | None = None,
        tier: str | None = None,
        durable: bool = False,
        next_use: float | None = None,
    ) -> Write:
        """A write of ``hashes`` (``parents[i]`` is block ``i``'s parent: the previous block
        of a chain segment, or None for keyed blocks that stand alone) of ``nbytes`` each
        (None: not known yet, checked per fill), into tier ``tier`` (default: the first, or
        the parent's if lower). ``next_use``: the new records' forecast (a session's: see
        ``sessioncache.store.forecast``; None: each its parent's). Checks what it can for all
        blocks (ids, the namespace's payload size, the TTL, a durable tier to write through
        to) before any is written."""
        if len(parents) != len(hashes):
            raise InvalidInput(f"{len(hashes)} ids but {len(parents)} parents")
        start = self._core.tier_by_name(tier) if tier is not None else 0
        ttl = self._core.default_ttl if ttl_s is None else check_ttl(ttl_s)
        self._core.check_ids(hashes, namespace_root, None)
        self._core.check_ids([p for p in parents if p is not None], namespace_root, None)
        if nbytes is not None:
            self._core.check_sizes(hashes, [nbytes] * len(hashes), namespace_root)
        durable_tier = self._core.first_durable(start) if durable else None
        if durable and durable_tier is None:
            raise InvalidInput("durable=True but no durable tier at or below the target tier")
        with self._core.lock:
            op = self._core.index.next_op()
            at = self._core.clock.now()
            self._core.counters.puts += 1
        n = len(hashes)
        return Write(
            secrets.token_hex(16),
            namespace_root,
            list(hashes),
            list(parents),
            nbytes,
            ttl,
            start,
            tier is not None,
            durable_tier,
            op,
            at,
            status=[None] * n,
            next_use=next_use,
        )

    def sync_for(self, write: Write, *, durable: bool = False) -> Sync:
        """The durability of one request filling some blocks of ``write`` (a REST upload):
        the write's, or with ``durable`` the first durable tier at or below its tier
        (``InvalidInput`` without one). Each request gets its own: it waits at ``settle``
        for its own blocks, never for another request's, and never for a durable copy it did
        not ask for."""
        tier = write.durable_tier
        if durable and tier is None:
            tier = self._core.first_durable(write.tier)
            if tier is None:
                raise InvalidInput("durable=true but this node has no durable tier")
        return Sync(tier)

    def fill(
        self, write: Write, index: int, payload: Payload, *, sync: Sync | None = None
    ) -> BlockStatus:
        """Store block ``index`` of a prepared write from ``payload``: ``STORED``, ``PRESENT``
        (held already, or another caller is storing it) or ``DROPPED`` (no tier could make
        room, or its parent is neither held nor being stored: a block never hangs off a parent
        the store lacks, so a chain is filled in order and the rest of it is dropped after a
        dropped block). ``sync``: the durability of the request filling it (``sync_for``;
        default the write's own, ``write.sync``). Raises ``DurableStoreFailed`` when a durable
        request's block could not reach the durable tier (it is then held, in memory only).
        With write-behind a block is queued for the durable tier; a durable request waits for
        its blocks at ``settle`` (several blocks, one sync)."""
        if sync is None:
            sync = write.sync
        block_hash = write.hashes[index]
        nbytes = payload_nbytes(payload)
        if write.nbytes is None:
            self._core.check_sizes([block_hash], [nbytes], write.namespace_root)
        elif nbytes != write.nbytes:
            raise PayloadSizeError(
                f"block {block_hash.hex()}: payload is {nbytes} bytes, but blocks of this "
                f"namespace are {write.nbytes} bytes"
            )
        parent = write.parents[index]
        if parent is not None and not self._core.live(parent):
            write.status[index] = BlockStatus.DROPPED
            self._count(dropped=1)
            return BlockStatus.DROPPED
        meta = self._claim(write, index, nbytes)
        if meta is None:
            if sync.durable_tier is not None:
                self._ensure_durable(sync, block_hash)
            write.status[index] = BlockStatus.PRESENT
            return BlockStatus.PRESENT
        durable = True
        try:
            # By default no faster than its parent: a fast tier holds the heads of chains,
            # which then leave it tail first, as they leave the store.
            with self._core.lock:
                target = (
                    write.tier
                    if write.exact_tier
                    else max(write.tier, self._core.index.parent_tier(meta))
                )
            placed = self._core.place(meta, payload, target)
            if placed is not None:
                durable = self._write_through(write, meta, payload, placed, sync)
        finally:
            self._core.unclaim(meta)
        status = BlockStatus.STORED if placed is not None else BlockStatus.DROPPED
        write.status[index] = status
        self._count(stored=int(placed is not None), dropped=int(placed is None))
        if not durable:
            self._durable_failed(sync, block_hash)
        return status

    def settle(self, write: Write, sync: Sync | None = None) -> None:
        """Wait for the durable copies of a durable request's blocks queued so far (one sync
        for many: ``store.behind``); ``DurableStoreFailed`` when one could not be made.
        ``sync``: the request's (``sync_for``; default the write's own)."""
        if sync is None:
            sync = write.sync
        tickets = sync.take()
        behind = self._core.behind
        if not tickets or behind is None:
            return
        behind.wait([t for _, t in tickets])
        for block_hash, ticket in tickets:
            if not ticket.ok:
                with self._core.lock:
                    meta = self._core.index.get(block_hash)
                    there = meta is not None and sync.durable_tier in meta.tiers
                if not there:
                    self._durable_failed(sync, block_hash)

    def _write_through(
        self, write: Write, meta: BlockMeta, payload: Payload, placed: int, sync: Sync | None = None
    ) -> bool:
        """Copy a block just placed in tier ``placed`` to the write-through tiers, and queue it
        for the durable tier (write-behind; a durable request's ticket is kept in its ``sync``
        for ``settle``), or without write-behind copy a durable request's block there now;
        False when that durable copy could not be made. ``sync``: default the write's own."""
        if sync is None:
            sync = write.sync
        durable = sync.durable_tier
        also = [t for t in self._core.write_through_tiers if t != placed]
        behind = self._core.behind
        queued = behind is not None and placed < behind.durable and behind.durable not in also
        if queued:
            assert behind is not None
            # waits while the queue is full: back-pressure
            ticket = behind.submit(meta, durable=durable is not None)
            if durable is not None:
                sync.add(meta.block_hash, ticket)
        elif durable is not None and durable not in (placed, *also):
            also.append(durable)
        shared = self._core.shared[0] if self._core.shared is not None else -1
        for extra in also:
            placed_there = self._core.place(meta, payload, extra, stop=extra + 1)
            if placed_there is None and extra == shared and self._core.shared_missed is not None:
                self._core.shared_missed(meta)  # published once the shared tier answers
        return queued or durable is None or durable in meta.tiers

    def _ensure_durable(self, sync: Sync, block_hash: BlockHash) -> None:
        """A block a durable request found held already (a retry after a durable write
        failed, or another caller's copy in memory only): copy it to the durable tier from a
        tier holding it, or raise ``DurableStoreFailed``. One another caller is storing now
        is left to that caller's write."""
        core = self._core
        durable = sync.durable_tier
        assert durable is not None
        with core.lock:
            meta = core.index.get(block_hash)
            if meta is None or not meta.mask or durable in meta.tiers:
                return
            core.index.ref(meta)  # in flight: not evicted under the copy
        try:
            data = core.tiers[min(meta.tiers)].get(block_hash)
            if data is not None:
                core.place(meta, data, durable, stop=durable + 1)
            ok = durable in meta.tiers
        finally:
            core.unclaim(meta)
        if not ok:
            self._durable_failed(sync, block_hash)

    def _claim(self, write: Write, i: int, nbytes: int) -> BlockMeta | None:
        """``StoreCore.claim`` of the write's block ``i`` alone (``nbytes``): its record, or
        None when it is held already (its TTL extended) or another caller is storing it."""
        return self._core.claim(write, i, 1, nbytes, stop=i + 1)[0]

    def _durable_failed(self, request: Write | Sync, block_hash: BlockHash) -> None:
        assert request.durable_tier is not None
        name = self._core.tiers[request.durable_tier].name
        raise DurableStoreFailed(
            f"the durable tier {name!r} could not take block {block_hash.hex()} (its "
            "filesystem is full, or nothing there can be evicted): the block is held in memory "
            "only, not durably; durable stores fail until space returns"
        )

    def _count(self, *, stored: int = 0, dropped: int = 0) -> None:
        with self._core.lock:
            self._core.counters.stored_blocks += stored
            self._core.counters.dropped_blocks += dropped

    def stage(
        self,
        hashes: Sequence[BlockHash],
        *,
        namespace_root: bytes,
        nbytes: int,
        parent: BlockHash | None = None,
        ttl_s: float | None = None,
        durable: bool = False,
        parents: Sequence[BlockHash | None] | None = None,
    ) -> Write:
        """``prepare`` a write into the shared-memory tier and ``reserve`` its slots: a slot
        of ``nbytes`` for each block not held yet (making room by eviction, as ``put`` does),
        for another process to fill in place; ``commit`` publishes them, ``abort`` frees
        them. A staged block is invisible to lookups until committed; its record is pinned
        meanwhile, so a ``put`` of the same id answers present. Staged slots never expire:
        their owner (a connection) aborts them when it ends, since a writer may still be
        filling them.

        ``parents`` gives each block's parent instead (keyed blocks that are no chain)."""
        shm_index, _ = self._core.require_shm()
        if parents is None:
            parents = [parent, *hashes[:-1]][: len(hashes)]
        write = self.prepare(
            hashes,
            namespace_root=namespace_root,
            nbytes=nbytes,
            parents=parents,
            ttl_s=ttl_s,
            tier=self._core.tiers[shm_index].name,
            durable=durable,
        )
        try:
            self.reserve(write)
        except BaseException:
            self.abort(write)
            raise
        return write

    def reserve(self, write: Write, slots: int | None = None) -> None:
        """Claim each block of a write prepared for the shared-memory tier and reserve its
        slot there: ``STORED`` (``slots[i]`` to fill), ``PRESENT`` (held, or being stored by
        another caller: nothing to write) or ``DROPPED`` (no room, or past ``slots`` reserved:
        the caller's share; so is every block after). The slots free now are taken at once
        and the blocks claimed under one lock; past them, each block makes room by eviction."""
        shm_index, tier = self._core.require_shm()
        nbytes = write.nbytes
        if nbytes is None or write.tier != shm_index:
            raise InvalidInput("reserve: a write prepared for the shared-memory tier, sized")
        core, n = self._core, len(write.hashes)
        left = n if slots is None else slots
        i = 0
        while i < n and left > 0:
            pool = tier.reserve_many(nbytes, min(left, n - i))
            used = 0
            try:
                claimed = core.claim(write, i, len(pool), nbytes)
                for meta in claimed:
                    if meta is None:
                        self._staged(write, BlockStatus.PRESENT, None, None)
                    else:
                        self._staged(write, BlockStatus.STORED, pool[used], meta)
                        used += 1
            finally:
                tier.release_many(pool[used:])
            i += len(claimed)
            left -= used
            if i == n or left <= 0:
                break
            # No room without eviction: this block makes its own.
            meta = self._claim(write, i, nbytes)
            if meta is None:
                self._staged(write, BlockStatus.PRESENT, None, None)
                i += 1
                continue
            try:
                slot = self._reserve(meta, shm_index)
            except BaseException:
                core.unclaim(meta)
                raise
            if slot is None:
                core.unclaim(meta)
                break
            self._staged(write, BlockStatus.STORED, slot, meta)
            i += 1
            left -= 1
        while len(write.slots) < n:
            self._staged(write, BlockStatus.DROPPED, None, None)

    @staticmethod
    def _staged(
        write: Write, status: BlockStatus, slot: StagedSlot | None, meta: BlockMeta | None
    ) -> None:
        write.status[len(write.slots)] = status
        write.slots.append(slot)
        write.metas.append(meta)

    def _reserve(self, meta: BlockMeta, index: int) -> StagedSlot | None:
        assert self._core.shm is not None
        tier = self._core.shm[1]
        for _ in range(_PLACE_ATTEMPTS):
            if self._core.tiers[index].fits(meta.nbytes):
                try:
                    return tier.reserve(meta.nbytes)
                except TierFull:
                    continue  # another thread took the room: evict again
            # waits while the only victims are being written behind: back-pressure
            if not self._core.make_room(index, meta):
                break
        return None

    def commit(
        self,
        write: Write,
        checksums: Sequence[int],
        lengths: Sequence[int] | None = None,
        *,
        copy_in: Callable[[int, StagedSlot], int] | None = None,
    ) -> WriteResult:
        """Publish the next ``len(checksums)`` blocks of a staged write (all of them in one
        call, or in order over several: a writer may commit the blocks it has filled while it
        fills the next) whose slots hold what the writer says it wrote: per block, the length
        (when given) and the XXH3-64 (seed 0) of the slot's bytes. A block that does not match
        is rejected, and every later block of the staging is dropped (they would hang off it).
        Published blocks are written through as a ``fill`` does; when a durable write's block
        cannot reach its durable tier, the rest of the write is aborted and
        ``DurableStoreFailed`` raised. Entries of present or dropped blocks are ignored.

        ``copy_in(i, slot)``, when given, fills the slot of block ``i`` just before it is
        checked and returns the XXH3-64 of what it copied there (hashed piece by piece from
        the slot itself): the writer wrote the block elsewhere (a same-host connection's
        staging memory), so what is checked and published is the node's own copy."""
        shm_index, tier = self._core.require_shm()
        n = len(checksums)
        if lengths is not None and len(lengths) != n:
            raise InvalidInput(f"{n} checksums but {len(lengths)} lengths")
        with self._core.lock:
            if not write.open:
                raise InvalidInput(f"staging {write.id} is already committed or aborted")
            start = write.claimed
            if not 0 < n <= len(write.hashes) - start:
                raise InvalidInput(
                    f"staging {write.id}: {n} blocks to commit, {len(write.hashes) - start} left"
                )
            write.claimed = start + n
        core, hashes, slots, metas = self._core, write.hashes, write.slots, write.metas
        status: list[BlockStatus] = []
        good: list[int] = []  # the blocks checked, to publish (as offsets from ``start``)
        freed: list[int] = []  # the blocks whose slots and records go
        try:
            for k in range(n):
                i = start + k
                slot = slots[i]
                if write.status[i] is BlockStatus.PRESENT:
                    status.append(BlockStatus.PRESENT)
                    continue
                if slot is None or metas[i] is None or write.broken:
                    freed.append(k)
                    status.append(BlockStatus.DROPPED)
                    continue
                if copy_in is not None:
                    checksum = copy_in(i, slot)
                else:
                    checksum = payload_checksum(as_memoryview(slot.payload))
                if (lengths is None or lengths[k] == slot.location.nbytes) and (
                    checksum == checksums[k]
                ):
                    good.append(k)
                    status.append(BlockStatus.STORED)
                else:
                    freed.append(k)
                    status.append(BlockStatus.REJECTED)
                    write.broken = True
        except BaseException:
            # Nothing of this commit is published: every block of it goes.
            freed = [k for k in range(n) if write.status[start + k] is not BlockStatus.PRESENT]
            self._free_staged(write, start, freed)
            raise
        # Published in one batch when no write-through can fail; else block by block, since
        # the blocks after one whose durable copy failed are dropped.
        behind = core.behind
        queued = (
            behind is not None
            and shm_index < behind.durable
            and behind.durable not in core.write_through_tiers
        )
        step = max(len(good), 1) if write.durable_tier is None or queued else 1
        # Queued for the durable tier and written through nowhere else: queued at once.
        at_once = queued and all(t == shm_index for t in core.write_through_tiers)
        unsaved: BlockHash | None = None
        try:
            for at in range(0, len(good), step):
                batch = good[at : at + step]
                if unsaved is not None:
                    freed.extend(batch)
                    for k in batch:
                        status[k] = BlockStatus.DROPPED
                    continue
                items = [(hashes[start + k], slots[start + k]) for k in batch]
                published = tier.publish_many([(h, slot) for h, slot in items if slot is not None])
                batch_metas = [metas[start + k] for k in batch]
                with core.lock:
                    for k, meta, ok in zip(batch, batch_metas, published, strict=True):
                        assert meta is not None
                        if ok:
                            meta.checksum = checksums[k]
                            core.add_to_tier(meta, shm_index)
                        else:
                            status[k] = BlockStatus.PRESENT
                try:
                    if at_once:
                        assert behind is not None
                        sync = write.sync
                        done = [
                            m
                            for m, ok in zip(batch_metas, published, strict=True)
                            if ok and m is not None
                        ]
                        tickets = behind.submit_many(done, durable=sync.durable_tier is not None)
                        for meta, ticket in zip(done, tickets, strict=False):
                            sync.add(meta.block_hash, ticket)
                    else:
                        for k, meta, ok in zip(batch, batch_metas, published, strict=True):
                            slot = slots[start + k]
                            assert meta is not None and slot is not None
                            if ok and not self._write_through(write, meta, slot.payload, shm_index):
                                unsaved = hashes[start + k]
                                break
                finally:
                    core.unclaim_many(m for m in batch_metas if m is not None)
        finally:
            self._free_staged(write, start, freed)
        write.status[start : start + n] = status
        result = WriteResult(write.hashes[start : start + n], status)
        with self._core.lock:
            if write.claimed == len(write.hashes):
                write.open = False
        self._count(stored=len(result.stored), dropped=len(result.dropped) + len(result.rejected))
        if unsaved is not None:
            self.abort(write)
            self._durable_failed(write, unsaved)
        if not write.open:
            self.settle(write)  # the last COMMIT answers once every block is on disk
        return result

    def abort(self, write: Write) -> int:
        """Free the slots of a staged write's blocks not committed yet and forget their
        records (nothing of them was visible); returns how many slots were freed (0 once the
        staging is wholly committed or aborted)."""
        with self._core.lock:
            if not write.open:
                return 0
            write.open = False
            start = write.claimed
            write.claimed = len(write.hashes)
        return self._free_staged(write, start, range(len(write.slots) - start))

    def _free_staged(self, write: Write, start: int, blocks: Sequence[int]) -> int:
        """Free the slots and forget the records of staged blocks ``start + k`` for ``k`` in
        ``blocks``; how many slots were freed."""
        slots = [s for k in blocks if (s := write.slots[start + k]) is not None]
        metas = [m for k in blocks if (m := write.metas[start + k]) is not None]
        self._core.require_shm()[1].release_many(slots)
        self._core.unclaim_many(metas)
        return len(slots)

    def delete(self, hashes: Sequence[BlockHash]) -> int:
        """Drop unpinned blocks from every tier; returns how many were dropped."""
        dropped = 0
        with self._core.lock:
            for block_hash in hashes:
                meta = self._core.index.get(block_hash)
                if meta is None or meta.ref_cnt:
                    continue
                for tier in sorted(meta.tiers):
                    self._core.drop_from_tier(meta, tier)
                dropped += 1
        return dropped

    def expire(self) -> int:
        """Drop every unpinned expired block from every tier; returns how many (the sweep)."""
        with self._core.lock:
            now = self._core.clock.now()
            self._core.index.leases.reap(now)
            victims = self._core.index.expired_unpinned(now)
            shared = self._core.shared[0] if self._core.shared is not None else -1
            for meta in victims:
                for tier in sorted(meta.tiers):
                    # Another node may have extended a shared key: let the server expire it.
                    self._core.drop_from_tier(meta, tier, delete=tier != shared)
            self._core.counters.expirations += len(victims)
            return len(victims)
