"""The GPU tier: slabs of fixed-size slots in device memory.

The device defaults to the current CUDA device when one exists, else ``torch.device("cpu")``.

What the tests exercise: they run without a GPU and build this tier on ``device="cpu"``, so
they cover the slab bookkeeping (allocation, slot reuse, chunk reclaim, the store's eviction
and promotion through it), not the device. Never run by the tests: the CUDA branch of
``default_device``, the host-to-device copy in ``SlabTier.put``, ``get`` handing out views
of device memory, and the device-to-host copy (``tiers.payload.as_memoryview``) when such a
view is demoted to a lower tier or read out over HTTP.
"""

from __future__ import annotations

import torch

from sessioncache.tiers.slab import DEFAULT_CHUNK_BYTES, SlabTier


def default_device() -> torch.device:
    """The current CUDA device, or the CPU when there is none."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class GpuTier(SlabTier):
    """Device slabs (see ``tiers.slab``)."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        name: str = "gpu",
        device: torch.device | str | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        super().__init__(
            name,
            capacity_bytes,
            torch.device(device) if device is not None else default_device(),
            chunk_bytes=chunk_bytes,
        )
