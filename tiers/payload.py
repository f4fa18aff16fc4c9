"""Payload conversions shared by the tiers: anything byte-like in, ``torch.uint8`` tensors out."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from sessioncache.errors import PayloadSizeError

Payload = bytes | bytearray | memoryview | npt.NDArray[Any] | torch.Tensor
"""What a tier accepts: any C-contiguous buffer or tensor; its bytes are the payload."""

# torch warns that a tensor over a read-only buffer (bytes) may not be written through; tiers
# only ever read from such tensors, so the warning is noise on every put.
warnings.filterwarnings("ignore", message="The given buffer is not writable", module="tiers")


def payload_nbytes(payload: Payload) -> int:
    """The payload's length in bytes."""
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    if isinstance(payload, np.ndarray):
        return int(payload.nbytes)
    return memoryview(payload).nbytes


def checked_nbytes(payload: Payload, tier: str, capacity_bytes: int) -> int:
    """The payload's length in bytes, checked for a ``put`` into the tier named ``tier``:
    ``PayloadSizeError`` when it is empty or larger than the whole tier."""
    nbytes = payload_nbytes(payload)
    if nbytes == 0:
        raise PayloadSizeError(f"{tier}: empty payload")
    if nbytes > capacity_bytes:
        raise PayloadSizeError(
            f"{tier}: payload of {nbytes} bytes exceeds the tier's capacity of {capacity_bytes}"
        )
    return nbytes


def as_byte_tensor(payload: Payload) -> torch.Tensor:
    """A flat ``torch.uint8`` view of the payload's bytes (no copy for contiguous input)."""
    if isinstance(payload, torch.Tensor):
        flat = payload.detach().contiguous().reshape(-1)
        return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    if isinstance(payload, np.ndarray):
        arr = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
        if arr.flags.writeable:
            return torch.from_numpy(arr)
        payload = arr.data
    view = memoryview(payload).cast("B")
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)


def as_memoryview(payload: Payload) -> memoryview:
    """The payload's bytes as a flat host memoryview (copies device tensors to the host)."""
    if isinstance(payload, torch.Tensor):
        flat = as_byte_tensor(payload)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        return flat.numpy().data.cast("B")
    if isinstance(payload, np.ndarray):
        return np.ascontiguousarray(payload).reshape(-1).view(np.uint8).data.cast("B")
    return memoryview(payload).cast("B")
