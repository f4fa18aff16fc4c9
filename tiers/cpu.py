"""The CPU tier: host-memory slabs of fixed-size slots, pinned when CUDA is present so that
device copies run at full PCIe speed; ``get`` hands out zero-copy views.

Pinning needs CUDA (without it torch refuses ``pin_memory=True``), and the tests run without
a GPU: they exercise unpinned slabs only, never a pinned allocation.
"""

from __future__ import annotations

import torch

from sessioncache.tiers.slab import DEFAULT_CHUNK_BYTES, SlabTier


class CpuTier(SlabTier):
    """Host slabs (see ``tiers.slab``)."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        name: str = "cpu",
        pin_memory: bool | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        super().__init__(
            name,
            capacity_bytes,
            torch.device("cpu"),
            pin_memory=pin_memory,
            chunk_bytes=chunk_bytes,
        )
