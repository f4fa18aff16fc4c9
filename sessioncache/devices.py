"""Copies between host memory and CUDA devices, and host memory registered with CUDA.

Every carrier that moves a block to or from a device tensor (the GPU and CPU tiers, the
same-host and stream clients, the transformers and paged-engine adapters) goes through these
primitives:

- ``cuda_device(obj)``: the CUDA device a tensor lies on; None for host memory (CPU tensors,
  numpy arrays, buffers). The device a copy uses is always its tensor's own, never the
  process's current one.
- ``DeviceCopies``: a batch of asynchronous copies, each on a copy stream of its device, and
  ``wait()``, the synchronisation point. Host memory a copy reads or writes (a leased slot, a
  staged one, a bounce buffer) is released, committed, hashed or reused only after ``wait``;
  used as a context manager, it waits on exit, also when the block raised. A copy stream
  first waits for the work already queued on the device's current stream, so a copy out of a
  tensor sees what the engine wrote into it.
- ``HostBounce``: host-to-device copies of data that arrives in host memory (a socket's
  bytes) through a ring of pinned buffers, each refilled only once its copy is done.
- ``HostRegistration``: a host mapping's pages registered with CUDA (``cudaHostRegister``,
  through torch's cudart), so that copies from and to it run as DMA at full PCIe speed and
  are truly asynchronous. Unregistered by ``close`` or when collected, before the mapping can
  go (the registration holds a reference to its owner). Without CUDA, or where the driver
  refuses (a read-only mapping on a device without ``cudaHostRegisterReadOnly``), there is no
  registration and copies from that memory are staged by the driver: correct, slower.

Without CUDA every copy is a plain synchronous ``copy_`` and ``wait`` returns at once, so the
same code runs in the tests on ``torch.device("cpu")``.

The client package (``sessioncache.connector``) uses this module and loads without torch:
torch is imported here only when a tensor was handed in (so it is loaded already), or where a
node registers its memory.
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings
import weakref
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
    "HostRegistration",
    "cuda_device",
    "cuda_present",
    "host_tensor",
    "pinned_empty",
]

_HOST_REGISTER_PORTABLE = 0x01
"""``cudaHostRegisterPortable``: pinned for every CUDA context of the process."""
_HOST_REGISTER_READ_ONLY = 0x08
"""``cudaHostRegisterReadOnly``: the device only reads it (a sealed, read-only mapping)."""


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


_streams: dict[int, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The copy stream of ``device`` (one per device, made on first use)."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    with _streams_lock:
        stream = _streams.get(index)
        if stream is None:
            stream = _streams[index] = torch.cuda.Stream(device=torch.device("cuda", index))  # type: ignore[no-untyped-call]
        return stream


class DeviceCopies:
    """A batch of copies between host memory and devices (see the module docstring)."""

    __slots__ = ("_streams",)

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}  # device index: its copy stream, used

    def copy(self, dst: Any, src: Any) -> None:
        """``dst.copy_(src)``, asynchronous where either lies on a CUDA device (on that
        device's copy stream); both are flat tensors of one size in bytes, or host memory
        (numpy arrays, buffers) on either side of a device tensor."""
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
        device = cuda_device(dst) or cuda_device(src)
        if device is None:
            if dst.device.type == src.device.type == "cpu":
                # numpy's memcpy: torch's copy_ of bytes on the host is several times slower
                np.copyto(host_tensor(dst).numpy(), host_tensor(src).numpy())
            else:
                dst.copy_(src)
            return
        stream = _copy_stream(device)
        index = stream.device.index
        if index not in self._streams:
            # Work the engine queued on the tensor (its current stream) comes first.
            stream.wait_stream(torch.cuda.current_stream(stream.device))
            self._streams[index] = stream
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    @property
    def pending(self) -> bool:
        """Whether copies were issued that ``wait`` has not seen complete."""
        return bool(self._streams)

    def wait(self) -> None:
        """Return once every copy issued so far is complete."""
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
            event.record(_copy_stream(device))
            self._ring[self._index] = (src, event)


def _unregister(address: int, what: str) -> None:
    import torch

    error = int(torch.cuda.cudart().cudaHostUnregister(address))  # type: ignore[no-untyped-call]
    if error:
        log.warning("cudaHostUnregister(%s) failed: cudaError %d", what, error)


class HostRegistration:
    """Host memory registered with CUDA (see the module docstring); ``register`` answers
    None where it cannot be."""

    registered_bytes = 0
    """Bytes registered now, in this process (for reports)."""
    refused = 0
    """Registrations the driver refused, in this process."""
    _lock = threading.Lock()
    _warned = False
    _announced = False

    def __init__(self, owner: object, address: int, nbytes: int, what: str) -> None:
        self.owner: object | None = owner
        self.address = address
        self.nbytes = nbytes
        self.what = what
        self._finalizer = weakref.finalize(self, HostRegistration._finish, address, nbytes, what)
        self._finalizer.atexit = False  # the process's exit unpins everything anyway

    @staticmethod
    def _finish(address: int, nbytes: int, what: str) -> None:
        _unregister(address, what)
        with HostRegistration._lock:
            HostRegistration.registered_bytes -= nbytes

    @classmethod
    def register(
        cls,
        memory: Any,
        *,
        read_only: bool = False,
        what: str = "host memory",
        device: torch.device | None = None,
    ) -> HostRegistration | None:
        """Register the pages of ``memory`` (a CPU tensor or numpy array over a mapping: it is
        kept alive while registered) with CUDA, through ``device``'s context (default: the
        current device's; the registration is portable to every context). None without CUDA
        or where the driver refuses (logged once)."""
        if not cuda_present():
            return None
        import torch

        tensor = host_tensor(memory)
        nbytes = tensor.numel()
        if nbytes == 0:
            return None
        address = tensor.data_ptr()
        flags = _HOST_REGISTER_PORTABLE | (_HOST_REGISTER_READ_ONLY if read_only else 0)
        with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
            error = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, flags))  # type: ignore[no-untyped-call]
        if error:
            with cls._lock:
                cls.refused += 1
                warned, cls._warned = cls._warned, True
            if not warned:
                log.warning(
                    "cudaHostRegister(%s, %d bytes%s) failed: cudaError %d; copies from it "
                    "are staged by the driver (slower)",
                    what,
                    nbytes,
                    ", read-only" if read_only else "",
                    error,
                )
            return None
        with cls._lock:
            first = cls.registered_bytes == 0 and not cls._announced
            cls._announced = True
            cls.registered_bytes += nbytes
        if first:
            log.info(
                "cudaHostRegister: host memory pinned for CUDA (portable%s), first %s",
                ", read-only" if read_only else "",
                what,
            )
        return cls(memory, address, nbytes, what)

    @property
    def live(self) -> bool:
        return self._finalizer.alive

    def close(self) -> None:
        """Unregister now (the memory stays mapped while others hold it)."""
        self._finalizer()
        self.owner = None
