"""The store loop every client runs, sans I/O: a store's blocks go out in chunks (a STORE or
STAGE of at most ``max_ids`` blocks, or one REST upload), each chunk continues the chain from
the last block of the one before, and once a block of a chain is not held (dropped, rejected)
the rest are not sent: they would hang off a block the node does not hold.

A client drives it::

    loop = StoreLoop(len(payloads), per=limits.max_ids, parent=parent)
    while (chunk := loop.next()) is not None:
        ids, status, durable = send(chunk, loop.parent)    # the carrier's own I/O
        loop.done(ids, status, durable)
    loop.drop_rest(ids_of(loop.rest))                       # what was never sent
"""

from __future__ import annotations

from collections.abc import Sequence

from sessioncache.errors import ProtocolError
from sessioncache.status import BlockStatus


class StoreLoop:
    def __init__(
        self, count: int, *, per: int, parent: bytes | None = None, linked: bool = True
    ) -> None:
        self.count = count
        self.per = max(1, per)
        self.linked = linked
        self.first_parent = parent
        self.ids: list[bytes] = []
        self.status: list[BlockStatus] = []
        self._sent = 0
        self._answers: list[bool] = []

    @property
    def broken(self) -> bool:
        """A block of the chain is not held: nothing after it is sent."""
        return self.linked and bool(self.status) and not self.status[-1].held

    @property
    def parent(self) -> bytes | None:
        """The parent of the next chunk's first block."""
        if not self.linked:
            return None if self.ids else self.first_parent
        return self.ids[-1] if self.ids else self.first_parent

    def next(self) -> range | None:
        """The blocks of the next chunk, or None when all are sent or the chain broke."""
        if self._sent >= self.count or self.broken:
            return None
        chunk = range(self._sent, min(self._sent + self.per, self.count))
        self._sent = chunk.stop
        return chunk

    def done(self, ids: Sequence[bytes], status: Sequence[BlockStatus], durable: bool) -> None:
        """The node's answer to the last chunk: each block's id and status."""
        if len(ids) != len(status):
            raise ProtocolError(f"an answer of {len(ids)} ids and {len(status)} statuses")
        self.ids += ids
        self.status += status
        self._answers.append(durable)

    @property
    def rest(self) -> range:
        """The blocks never sent (after a broken chain)."""
        return range(len(self.status), self.count)

    def drop_rest(self, ids: Sequence[bytes]) -> None:
        """Record the blocks never sent as dropped, with their ids (the caller derives them)."""
        if len(ids) != len(self.rest):
            raise ProtocolError(f"{len(ids)} ids for {len(self.rest)} blocks not sent")
        self.ids += ids
        self.status += [BlockStatus.DROPPED] * len(ids)

    @property
    def durable(self) -> bool:
        """Every chunk was answered as on a durable tier (False when nothing was sent)."""
        return bool(self._answers) and all(self._answers)
