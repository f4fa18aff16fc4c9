"""The GPU tier: slabs of fixed-size slots in device memory.

The device is the one given, else the current CUDA device when one exists, else
``torch.device("cpu")``. A put copies on that device's copy stream and publishes the block
once the copy is complete; ``get`` hands out a view of device memory, which the caller copies
where it goes (a block demoted to a host tier is copied there straight from the device).
``tests/gpu`` runs this tier on ``cpu`` in CI and on ``cuda`` where a GPU is present.
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
