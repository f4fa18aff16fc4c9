"""Records of blocks a tier holds that a ``BlockIndex`` did not make: the fleet's shared tier
(``located``) and what durable tiers found on start (``recovered``, then ``relink`` once)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from sessioncache.hashing import BlockHash
from sessioncache.store.blocks import BlockMeta
from sessioncache.store.eviction import is_spare, is_tail
from sessioncache.store.table import F_LIVE, NO_SLOT
from sessioncache.tiers.base import LocatedBlock, RecoveredBatch

if TYPE_CHECKING:
    from sessioncache.store.index import BlockIndex


class IndexAdoption:
    """Adoption into one index (it reaches into the index's table, orphans and expiry: the
    three are the index's own parts, kept apart only to keep each class small)."""

    def __init__(self, index: BlockIndex) -> None:
        self._index = index

    def located(
        self, block_hash: BlockHash, remote: LocatedBlock, now: float, default_ttl: float
    ) -> BlockMeta:
        """The record of a block the fleet's shared tier holds unexpired (``remote``), made
        or with its expiry raised to the shared one; the caller adds the copy."""
        assert remote.expires_at is not None
        meta = self._index.get(block_hash)
        if meta is None:
            return self._index.new_record(
                block_hash,
                parent=remote.parent,
                namespace_root=remote.namespace_root,
                nbytes=remote.nbytes,
                ttl_s=max(default_ttl, remote.expires_at - now),
                created=now,
                expires_at=remote.expires_at,
            )
        meta.expires_at = max(meta.expires_at, remote.expires_at)
        return meta

    def recovered(self, found: RecoveredBatch, tier: int, now: float, default_ttl: float) -> None:
        """Index blocks a durable tier found on start (``tier`` holds them), the new ones a
        column at a time in consecutive slots; ``relink`` once all are in."""
        table = self._index._table
        slot_of, mask = table.slot_of, table.mask
        bit = 1 << tier
        fresh: list[int] = []  # rows of ids without a record
        seen: set[BlockHash] = set()
        for row, block_hash in enumerate(found.ids):
            slot = slot_of.get(block_hash)
            if slot is None:
                if block_hash not in seen:
                    seen.add(block_hash)
                    fresh.append(row)
            elif not mask[slot] & bit:
                mask[slot] |= bit
                self._index.tier_blocks[tier] += 1
        if not fresh:
            return
        n = len(fresh)
        if n == len(found):  # the usual case: every row new
            hashes, parents, roots = found.ids, found.parents, found.namespace_roots
            rows: slice | list[int] = slice(None)
        else:
            rows = fresh
            hashes = [found.ids[i] for i in fresh]
            parents = [found.parents[i] for i in fresh]
            roots = [found.namespace_roots[i] for i in fresh]
        created = found.mtime[rows]
        ttl = found.ttl_s[rows]
        ttl = np.where(np.isnan(ttl), default_ttl, ttl)
        last = np.minimum(created, now)
        expires = found.expires_at[rows]
        expires = np.where(np.isnan(expires), last + ttl, expires)
        table.new_many(
            hashes,
            parents,
            roots,
            found.nbytes[rows],
            ttl,
            created,
            last,
            expires,
            bit,
            self._index._next_order(n),
        )
        self._index.tier_blocks[tier] += n
        self._index._expiry.add_many(hashes, expires)

    def relink(self) -> None:
        """After ``recovered``: every kid list (and the orphans), each record's held
        children, per tier and in all, and the eviction order of every tier, made anew from
        the records' parents, a column at a time."""
        table, tiers = self._index._table, self._index._num_tiers
        size = table.size
        slot_of, parents = table.slot_of, table.parents
        live = np.fromiter(slot_of.values(), np.int64, len(slot_of))
        # each record's parent slot: -1 without a parent, -2 for a parent without a record
        owner = np.fromiter(
            (
                -1 if (parent := parents[slot]) is None else slot_of.get(parent, -2)
                for slot in live.tolist()
            ),
            np.int64,
            len(live),
        )
        col = table.column
        first, after, before = col("first_kid"), col("next_kid"), col("prev_kid")
        first[:] = after[:] = before[:] = NO_SLOT
        linked = owner >= 0
        order = np.argsort(owner[linked], kind="stable")
        kids, owners = live[linked][order], owner[linked][order]
        same = owners[1:] == owners[:-1]  # kids[i + 1] follows kids[i] in one list
        after[kids[:-1][same]] = kids[1:][same]
        before[kids[1:][same]] = kids[:-1][same]
        heads = np.ones(len(kids), bool)
        heads[1:] = ~same
        first[owners[heads]] = kids[heads]
        self._index._orphans.clear()
        for slot in live[owner == -2].tolist():
            parent = parents[slot]
            assert parent is not None
            self._index._orphans[parent] = table.push_kid(
                self._index._orphans.get(parent, NO_SLOT), slot
            )
        masks = col("mask").astype(np.int64)
        kid_masks = masks[kids]
        col("held")[:] = np.bincount(owners[kid_masks != 0], minlength=size)
        children_in = col("children_in").reshape(size, tiers)
        both = kid_masks & masks[owners]
        for tier in range(tiers):
            here = (both >> tier & 1).astype(bool)
            children_in[:, tier] = np.bincount(owners[here], minlength=size)
        for tier in range(tiers):
            candidate = self._candidates(tier, masks, children_in[:, tier]).tolist()
            self._index._policy.rebuild(
                tier,
                [BlockMeta.at(table, s, key) for key, s in slot_of.items() if candidate[s]],
            )

    def _candidates(
        self, tier: int, masks: npt.NDArray[np.int64], children_here: npt.NDArray[np.int32]
    ) -> npt.NDArray[np.bool_]:
        """Which slots the policy may queue in ``tier`` (``eviction.candidacy``: a spare copy
        or an evictable tail there), for all slots at once."""
        col = self._index._table.column
        ref, holds, held = col("ref"), col("pins"), col("held")
        if tier != self._index._table.slots_tier:  # ``BlockMeta.standing``
            holds = holds + col("leased")
        spare = is_spare(masks, ref, holds, tier)
        last = tier == self._index._num_tiers - 1
        tail = is_tail(masks, ref, children_here, held, tier, last)
        live = (col("flags") & F_LIVE).astype(bool)
        result: npt.NDArray[np.bool_] = (spare | tail) & live
        return result
