"""What both ends of the same-host path do to a slot (sans-IO: numpy and the payload checksum
only): copy a block in while hashing it. The client fills its staging slots this way, the node
its CPU-tier slots at COMMIT."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from sessioncache.hashing import payload_hasher

PIECE = 512 << 10
"""Copied, then hashed while it is still in cache."""


def copy_and_hash(dst: npt.NDArray[np.uint8], src: npt.NDArray[np.uint8]) -> int:
    """Copy ``src`` into ``dst`` piece by piece, hashing each piece of ``dst`` while it is in
    cache (``src`` is read once); the ``hashing.payload_checksum`` of what ``dst`` now holds."""
    hasher = payload_hasher()
    for start in range(0, dst.nbytes, PIECE):
        piece = dst[start : start + PIECE]
        np.copyto(piece, src[start : start + PIECE])
        hasher.update(piece.data)
    return hasher.intdigest()
