"""Blocks the fleet's shared tier missed while it was unreachable, published once it answers.

Every store copies its blocks to the shared tier (write-through) so that other nodes find
them. While that tier's server is down the copy fails and the block is held here only; the
write path records it (``note``), and once the shared tier answers again a background loop
copies what is still held here to it, a batch per step, so that other nodes see it too.

Bounded and fair: each tenant (the owner of a block's namespace root) keeps at most
``tenant_share`` of ``bound_blocks`` records, its oldest forgotten first past that, and past
``bound_blocks`` in all the tenant holding the most loses its oldest (``dropped``: those stay
local); a step takes the tenants in turn, a block each, so that one tenant's backlog never
delays another's. A block no longer held here, or held there already, is skipped. A step ends
at the first copy that fails (the tier is down again, or full): that block and the rest of
the step's are put back at the head of their tenants' lines.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from itertools import cycle

from sessioncache.background import BackgroundLoop
from sessioncache.hashing import BlockHash
from sessioncache.store.blocks import BlockMeta
from sessioncache.store.core import StoreCore
from sessioncache.tiers.base import CheckedTier

log = logging.getLogger("sessioncache.store.republish")

DEFAULT_BOUND_BLOCKS = 1 << 20
DEFAULT_TENANT_SHARE = 0.5
BATCH_BLOCKS = 64
INTERVAL_S = 1.0


class Republisher:
    """The shared tier's missed copies of one store (module docstring)."""

    def __init__(
        self,
        core: StoreCore,
        shared: int,
        owner: Callable[[bytes], str],
        *,
        bound_blocks: int = DEFAULT_BOUND_BLOCKS,
        tenant_share: float = DEFAULT_TENANT_SHARE,
        interval_s: float = INTERVAL_S,
    ) -> None:
        self._core = core
        self._shared = shared
        self._owner = owner
        self._bound = bound_blocks
        self._tenant_cap = max(1, int(bound_blocks * tenant_share))
        self._count = 0
        self._missed: dict[str, OrderedDict[BlockHash, None]] = {}
        self.published = 0
        self.dropped = 0
        """Records forgotten past a tenant's share: those blocks stay local."""
        self._loop = BackgroundLoop("shared-republish", self.step, interval_s)
        self._loop.start()

    @property
    def pending(self) -> int:
        return self._count

    def note(self, meta: BlockMeta) -> None:
        """The write-through copy of ``meta`` to the shared tier failed."""
        self._record(self._owner(meta.namespace_root), [meta.block_hash], front=False)

    def _record(self, tenant: str, hashes: list[BlockHash], *, front: bool) -> None:
        with self._core.lock:
            missed = self._missed.setdefault(tenant, OrderedDict())
            for block_hash in hashes:
                self._count += block_hash not in missed
                missed[block_hash] = None
                if front:
                    missed.move_to_end(block_hash, last=False)
            while len(missed) > self._tenant_cap:
                missed.popitem(last=False)
                self._count -= 1
                self.dropped += 1
            while self._count > self._bound:
                largest = max(self._missed.values(), key=len)
                largest.popitem(last=False)
                self._count -= 1
                self.dropped += 1

    def step(self) -> None:
        """Copy a batch of what the shared tier missed, once it answers."""
        if not self.pending:
            return
        tier = self._core.tiers[self._shared]
        if isinstance(tier, CheckedTier) and tier.problem() is not None:
            return
        taken = self._take(BATCH_BLOCKS)
        for i, (_, block_hash) in enumerate(taken):
            if not self._publish(block_hash):
                for back in reversed(taken[i:]):  # at the head of their lines, in order
                    self._record(back[0], [back[1]], front=True)
                return

    def _take(self, count: int) -> list[tuple[str, BlockHash]]:
        """Up to ``count`` records (tenant, id), the tenants in turn, removed."""
        taken: list[tuple[str, BlockHash]] = []
        with self._core.lock:
            for tenant in cycle(list(self._missed)):
                if len(taken) >= count or not self._missed:
                    break
                missed = self._missed.get(tenant)
                if missed is None:
                    continue
                taken.append((tenant, missed.popitem(last=False)[0]))
                self._count -= 1
                if not missed:
                    del self._missed[tenant]
        return taken

    def _publish(self, block_hash: BlockHash) -> bool:
        """Copy one block from a local tier to the shared one; False when the copy failed
        (nothing to copy is no failure)."""
        core, shared = self._core, self._shared
        with core.lock:
            meta = core.index.get(block_hash)
            local = [t for t in meta.tiers if t != shared] if meta is not None else []
            if meta is None or not local or shared in meta.tiers:
                return True
            core.index.ref(meta, in_flight=True)  # not evicted under the copy
        try:
            data = core.tiers[min(local)].get(block_hash)
            if data is None:
                return True
            if core.place(meta, data, shared, stop=shared + 1, wait=False) is None:
                return False
            self.published += 1
            return True
        finally:
            with core.lock:
                core.index.unref(meta, in_flight=True)
                if not meta.tiers:
                    core.index.forget(meta)

    def close(self) -> None:
        self._loop.stop()
