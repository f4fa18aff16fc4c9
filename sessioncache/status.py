"""What a store did with each block: the one vocabulary of the store, the operation layer, both
wire formats and every client.

A ``BlockStatus`` is a ``str`` (``"stored"`` == ``BlockStatus.STORED``), so that JSON answers
and client results carry the name; the block stream carries its ``code`` (one byte). Only the
frame codec turns codes into statuses (``of_code``), and an unknown code is an error there,
never a status of its own.
"""

from __future__ import annotations

from enum import StrEnum

from sessioncache.errors import InvalidInput


class BlockStatus(StrEnum):
    STORED = "stored"
    """Written by this store (to a stage: a slot was given, to fill)."""
    PRESENT = "present"
    """Already held, or being stored by another caller: nothing written."""
    DROPPED = "dropped"
    """Not stored: no tier could make room, or it hangs off a block that is not held."""
    REJECTED = "rejected"
    """Not stored: a same-host slot did not hold the length and checksum its writer gave."""

    @property
    def code(self) -> int:
        """The block stream's byte for this status."""
        return _CODES[self]

    @property
    def held(self) -> bool:
        """The node holds the block after the store (stored or present)."""
        return self is BlockStatus.STORED or self is BlockStatus.PRESENT

    @classmethod
    def of_code(cls, code: int) -> BlockStatus:
        try:
            return _BY_CODE[code]
        except (IndexError, TypeError):
            raise InvalidInput(f"unknown block status code {code!r}") from None


_BY_CODE: tuple[BlockStatus, ...] = tuple(BlockStatus)
_CODES: dict[BlockStatus, int] = {status: code for code, status in enumerate(_BY_CODE)}


def kept(status: list[BlockStatus]) -> int:
    """How many blocks from the first are held (stored or present)."""
    for i, s in enumerate(status):
        if not s.held:
            return i
    return len(status)
