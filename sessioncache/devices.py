"""Copies between host memory and CUDA devices.

Every carrier that moves a block to or from a device tensor (the GPU and CPU tiers, the
same-host and stream clients, the transformers and paged-engine adapters) goes through these
primitives:

- ``cuda_device(obj)``: the CUDA device a tensor lies on; None for host memory (CPU tensors,
  numpy arrays, buffers). The device a copy uses is always its tensor's own, never the
  process's current one.
- ``DeviceCopies``: a batch of asynchronous copies, each on a copy stream of its device and
  direction (host to device, device to host), and ``wait()``, the synchronisation point.
  Host memory a copy reads or writes (a leased slot, a staged one, a bounce buffer) is
  released, committed, hashed or reused only after ``wait``; used as a context manager, it
  waits on exit, also when the block raised. A copy stream first waits for the work already
  queued on the device's current stream, so a copy out of a tensor sees what was written
  into it on that stream (a thread other than the engine's must first wait for the engine's
  work itself: ``connector.paged`` saves do).
- Host memory the device cannot reach by DMA (not pinned, not registered: a read-only
  mapping where the device does not pin those, ``sessioncache.hostpin``) goes to the device
  through pinned buffers that a few threads fill chunk by chunk, each chunk copied on as soon
  as it is full, instead of the driver's own one-thread staging.
- ``HostBounce``: host-to-device copies of data that arrives in host memory (a socket's
  bytes) through a ring of pinned buffers, each refilled only once its copy is done.

Without CUDA every copy is a plain synchronous copy and ``wait`` returns at once, so the
same code runs in the tests on ``torch.device("cpu")``.

The client package (``sessioncache.connector``) uses this module and loads without torch:
torch is imported here only when a tensor was handed in (so it is loaded already).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any, Self

import numpy as np

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# torch warns that a tensor over a read-only buffer (a sealed mapping, bytes) may not be
# written through; these copies only read from such tensors.
warnings.filterwarnings(
    "ignore", message="The given (buffer|NumPy array) is not writable", module=__name__
)

__all__ = [
    "DeviceCopies",
    "HostBounce",
    "cuda_device",
    "cuda_present",
    "host_tensor",
    "pinned_empty",
]


def cuda_present() -> bool:
    """Whether this process can use CUDA."""
    import torch

    return torch.cuda.is_available()


def is_tensor(obj: Any) -> bool:
    """Whether ``obj`` is a torch tensor (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def on_device(obj: Any) -> bool:
    """Whether ``obj`` is a tensor off the host (CUDA, or another accelerator)."""
    return is_tensor(obj) and obj.device.type != "cpu"


def cuda_device(obj: Any) -> torch.device | None:
    """The CUDA device ``obj`` lies on (a tensor on a device), else None."""
    if is_tensor(obj) and obj.device.type == "cuda":
        device: torch.device = obj.device
        return device
    return None


def device_bytes(tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A contiguous device tensor's bytes, flat, checked to be ``nbytes`` long."""
    import torch

    from sessioncache.errors import InvalidInput, PayloadSizeError

    if not tensor.is_contiguous():
        raise InvalidInput("a device tensor must be contiguous")
    flat = tensor.detach().reshape(-1)
    if flat.element_size() * flat.numel() != nbytes:
        raise PayloadSizeError(f"a block of {nbytes} bytes and a device tensor of another size")
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def host_tensor(buffer: Any) -> torch.Tensor:
    """A flat ``uint8`` tensor over host memory (a numpy array, a CPU tensor, a buffer),
    without copying."""
    import torch

    if isinstance(buffer, torch.Tensor):
        flat = buffer.detach().reshape(-1)
        return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
    if isinstance(buffer, np.ndarray):
        return torch.from_numpy(buffer.reshape(-1).view(np.uint8))
    return torch.frombuffer(memoryview(buffer).cast("B"), dtype=torch.uint8)


def pinned_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory, page-locked when CUDA is present (torch's caching host
    allocator: reused only once the copies recorded on it are done)."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda_present())


_streams: dict[tuple[int, bool], torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def _copy_stream(device: torch.device, to_device: bool = True) -> torch.cuda.Stream:
    """The copy stream of ``device`` for one direction (made on first use): loads to the
    device never queue behind the copies of saves off it."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (int(index), to_device)
    with _streams_lock:
        stream = _streams.get(key)
        if stream is None:
            stream = torch.cuda.Stream(device=torch.device("cuda", index))  # type: ignore[no-untyped-call]
            _streams[key] = stream
        return stream


STAGE_MIN_BYTES = 256 << 10
"""Below this, a copy from unpinned host memory is left to the driver's own staging."""
STAGE_CHUNK_BYTES = 8 << 20


class _Stager:
    """Copies from unpinned host memory to a device through pinned chunks (module
    docstring): ``threads`` fill them, each chunk copied on once full, a chunk's buffer
    refilled once its copy is done."""

    def __init__(self, threads: int) -> None:
        import queue
        from concurrent.futures import ThreadPoolExecutor

        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="sessioncache-stage")
        self._free: queue.SimpleQueue[tuple[torch.Tensor, torch.cuda.Event | None]] = (
            queue.SimpleQueue()
        )
        for _ in range(2 * threads):
            self._free.put((pinned_empty(STAGE_CHUNK_BYTES), None))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """Queue ``src`` (host, flat bytes) to ``dst`` (device, flat bytes) on ``stream``;
        returns once every chunk is queued (``stream`` completes them)."""
        import torch

        n = src.numel()
        starts = range(0, n, STAGE_CHUNK_BYTES)

        def one(start: int) -> None:
            stop = min(start + STAGE_CHUNK_BYTES, n)
            buf, done = self._free.get()
            try:
                if done is not None:
                    done.synchronize()
                piece = buf[: stop - start]
                np.copyto(piece.numpy(), src[start:stop].numpy())  # numpy releases the GIL
                with torch.cuda.stream(stream):
                    dst[start:stop].copy_(piece, non_blocking=True)
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(stream)
            finally:
                self._free.put((buf, done))

        for future in [self._pool.submit(one, s) for s in starts]:
            future.result()


@functools.cache
def _stager() -> _Stager:
    return _Stager(max(1, min(4, (os.cpu_count() or 2) // 2)))


class DeviceCopies:
    """A batch of copies between host memory and devices (see the module docstring)."""

    __slots__ = ("_lock", "_streams")

    def __init__(self) -> None:
        self._streams: dict[tuple[int, bool], torch.cuda.Stream] = {}  # the streams used
        self._lock = threading.Lock()

    def copy(self, dst: Any, src: Any) -> None:
        """``dst.copy_(src)``, asynchronous where either lies on a CUDA device (on that
        device's copy stream for the direction); both are flat tensors of one size in bytes,
        or host memory (numpy arrays, buffers) on either side of a device tensor."""
        import torch

        if not isinstance(dst, torch.Tensor):
            dst = host_tensor(dst)
        if not isinstance(src, torch.Tensor):
            src = host_tensor(src)
        if dst.numel() * dst.element_size() != src.numel() * src.element_size():
            raise ValueError(
                f"a copy of {src.numel() * src.element_size()} bytes into "
                f"{dst.numel() * dst.element_size()}"
            )
        to_device = cuda_device(dst) is not None
        device = cuda_device(dst) or cuda_device(src)
        if device is None:
            if dst.device.type == src.device.type == "cpu":
                # numpy's memcpy: torch's copy_ of bytes on the host is several times slower
                np.copyto(host_tensor(dst).numpy(), host_tensor(src).numpy())
            else:
                dst.copy_(src)
            return
        stream = _copy_stream(device, to_device)
        key = (stream.device.index, to_device)
        with self._lock:
            if key not in self._streams:
                # Work queued on the device's current stream comes first.
                stream.wait_stream(torch.cuda.current_stream(stream.device))
                self._streams[key] = stream
        if (
            to_device
            and src.device.type == "cpu"
            and src.numel() * src.element_size() >= STAGE_MIN_BYTES
            and not src.is_pinned()
        ):
            _stager().copy(host_tensor(dst), host_tensor(src), stream)
            return
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def wait(self) -> None:
        """Return once every copy issued so far is complete."""
        with self._lock:
            streams, self._streams = self._streams, {}
        if not streams:
            return
        import torch

        for stream in streams.values():
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
            event.synchronize()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.wait()


class HostBounce:
    """Host-to-device copies of bytes that arrive in host memory, through ``depth`` pinned
    buffers: ``buffer(nbytes)`` hands out the next one (once its previous copy is done), and
    ``upload(dst)`` copies what was written into it to ``dst`` on ``copies``."""

    def __init__(self, copies: DeviceCopies, depth: int = 4) -> None:
        self._copies = copies
        self._ring: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._depth = max(1, depth)
        self._next = 0
        self._current: torch.Tensor | None = None
        self._index = 0

    def buffer(self, nbytes: int) -> torch.Tensor:
        if len(self._ring) < self._depth:
            tensor = pinned_empty(nbytes)
            self._ring.append((tensor, None))
            index = len(self._ring) - 1
        else:
            index = self._next
            self._next = (self._next + 1) % self._depth
            tensor, event = self._ring[index]
            if event is not None:
                event.synchronize()
            if tensor.numel() != nbytes:
                tensor = pinned_empty(nbytes)
            self._ring[index] = (tensor, None)
        self._current = tensor
        self._index = index
        return tensor

    def upload(self, dst: torch.Tensor) -> None:
        if self._current is None:
            raise RuntimeError("upload before buffer")
        src, self._current = self._current, None
        self._copies.copy(dst, src)
        device = cuda_device(dst)
        if device is not None:
            import torch

            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(_copy_stream(device, True))
            self._ring[self._index] = (src, event)
