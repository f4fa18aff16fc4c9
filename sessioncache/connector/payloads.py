"""What the data-plane clients and ``KVTransfer`` send: flat byte views of the caller's buffers
(numpy arrays, torch tensors, anything with the buffer protocol), and the units of a STORE or
STAGE (its tokens or keys, its payloads' one size, its TTL, the ids the node will derive)."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from sessioncache.dataplane.frames import StoreHead
from sessioncache.errors import InvalidInput, PayloadSizeError
from sessioncache.hashing import (
    KEY_BYTES,
    Namespace,
    Tokens,
    tokens_to_le_bytes,
)
from sessioncache.hashing import segment_ids as derive_segment_ids


class Filler(abc.ABC):
    """A payload that copies itself where it goes (a block gathered from an engine's paged
    cache, ``connector.paged``): the same-host store fills its staging slot in place, the
    stream fills a buffer it then sends. A base class, not a protocol: the clients tell it
    from a buffer once per block, and ``isinstance`` of a protocol costs microseconds."""

    __slots__ = ()

    @property
    @abc.abstractmethod
    def nbytes(self) -> int: ...

    @abc.abstractmethod
    def write_into(self, dst: npt.NDArray[np.uint8]) -> None:
        """Write the payload's ``nbytes`` bytes into ``dst``."""


def filled(payload: Filler) -> npt.NDArray[np.uint8]:
    """A filler's bytes in a new array."""
    out = np.empty(payload.nbytes, np.uint8)
    payload.write_into(out)
    return out


def _torch_view(obj: Any, writable: bool) -> memoryview:
    if obj.device.type != "cpu":
        if writable:
            raise InvalidInput("load_into takes CPU tensors: load, then copy to the device")
        obj = obj.cpu()
    flat = obj.detach()
    if not flat.is_contiguous():
        raise InvalidInput("a tensor buffer must be contiguous")
    flat = flat.reshape(-1)
    if flat.element_size() != 1 or flat.dtype.is_floating_point:
        import torch

        flat = flat.view(torch.uint8)
    view: memoryview = flat.numpy().data
    return view


def as_buffer(obj: Any, *, writable: bool) -> memoryview:
    """A flat byte view of a numpy array, a torch tensor, or anything with the buffer
    protocol, without copying (a device tensor is copied to the host for reading only; a
    ``Filler`` is filled into a new array)."""
    if isinstance(obj, Filler):
        if writable:
            raise InvalidInput("a filler payload cannot be loaded into")
        obj = filled(obj)
    if type(obj).__module__.startswith("torch"):
        view = _torch_view(obj, writable)
    elif isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise InvalidInput("an array buffer must be C-contiguous")
        view = obj.reshape(-1).view(np.uint8).data
    else:
        try:
            view = memoryview(obj)
        except TypeError:
            raise InvalidInput(f"{type(obj).__name__} is not a buffer") from None
    if writable and view.readonly:
        raise InvalidInput(f"a read-only {type(obj).__name__} cannot be loaded into")
    if not view.c_contiguous:
        raise InvalidInput("a buffer must be contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def store_tokens(namespace: Namespace, tokens: Tokens, blocks: int) -> bytes:
    """``tokens`` as little-endian bytes, checked to be exactly ``blocks`` full blocks."""
    token_bytes = tokens_to_le_bytes(tokens)
    if len(token_bytes) != 4 * namespace.block_tokens * blocks:
        raise InvalidInput(
            f"{len(token_bytes) // 4} tokens for {blocks} blocks of {namespace.block_tokens} tokens"
        )
    return token_bytes


def one_size(sizes: Iterable[int]) -> int:
    """The one non-zero payload size of a store's payloads."""
    distinct = set(sizes)
    if len(distinct) != 1 or 0 in distinct:
        raise PayloadSizeError("the payloads of one store must all have the same non-zero size")
    return distinct.pop()


def store_ttl_ms(ttl_s: float | None) -> int:
    """A STORE's TTL field: milliseconds, 0 for the node's default."""
    if ttl_s is not None and not 0 < ttl_s < (1 << 32) / 1000:
        raise InvalidInput(f"ttl_s must be positive and below 49 days, got {ttl_s}")
    return 0 if ttl_s is None else max(1, round(ttl_s * 1000))


def key_bytes(keys: Sequence[bytes]) -> bytes:
    """Block keys (16 bytes each, ``hashing.block_key``) as a keyed STORE's key section."""
    for key in keys:
        if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
            raise InvalidInput(f"a block key is {KEY_BYTES} bytes, got {key!r:.60}")
    return b"".join(keys)


def segment_ids(head: StoreHead, units: bytes, seed: int) -> list[bytes]:
    """The ids the node derives for one STORE or STAGE (``units``: its token or key section;
    ``hashing.segment_ids``)."""
    return list(
        derive_segment_ids(
            head.root, head.parent, units, head.block_tokens, keyed=head.keyed, seed=seed
        )
    )
