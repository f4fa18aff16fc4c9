"""What both ends of the same-host path do to a slot (sans-IO: numpy and xxhash only): copy a
block in while hashing it. The client fills its staging slots this way, the node its CPU-tier
slots at COMMIT."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import xxhash

PIECE = 512 << 10
"""Copied, then hashed while it is still in cache."""


def copy_and_hash(dst: npt.NDArray[np.uint8], src: npt.NDArray[np.uint8]) -> int:
    """Copy ``src`` into ``dst`` piece by piece, hashing each piece of ``dst`` while it is in
    cache (``src`` is read once); the XXH3-64 (seed 0) of what ``dst`` now holds."""
    hasher = xxhash.xxh3_64()
    for start in range(0, dst.nbytes, PIECE):
        piece = dst[start : start + PIECE]
        np.copyto(piece, src[start : start + PIECE])
        hasher.update(piece.data)
    return int(hasher.intdigest())
