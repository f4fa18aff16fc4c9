"""Host memory registered with CUDA (``cuMemHostRegister``), so that copies between it and
a device run as DMA at full PCIe speed and truly asynchronously.

``HostRegistration.register(memory, read_only=...)`` pins the pages of a host mapping (a CPU
tensor or numpy array over it, kept alive while registered) for every CUDA context of the
process (portable). It goes through the driver API (``libcuda``, by ``ctypes``), in the
device's primary context (the one the CUDA runtime and torch use): a refused registration
there leaves no error behind for the runtime's next kernel launch to trip on, as a refused
``cudaHostRegister`` would. Unregistered by ``close``, or when collected, before the mapping
can go (the registration holds its owner).

Where it cannot be (no CUDA; the driver refuses: a read-only mapping on a device without
``CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED``), ``register`` answers None, logs
once, and copies from that memory are staged through pinned buffers instead
(``sessioncache.devices``). ``read_only_supported(device)`` says which a device does.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

__all__ = ["HostRegistration", "read_only_supported"]

_PORTABLE = 0x01
"""``CU_MEMHOSTREGISTER_PORTABLE``: pinned for every CUDA context of the process."""
_READ_ONLY = 0x08
"""``CU_MEMHOSTREGISTER_READ_ONLY``: the device only reads it (a sealed, read-only mapping)."""
_ATTR_READ_ONLY_HOST_REGISTER = 113
_T = TypeVar("_T")


@functools.cache
def _driver() -> ctypes.CDLL | None:
    """The CUDA driver library, or None where it cannot be loaded."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    vp, sz, ui, ci = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int
    for name, args in (
        ("cuInit", [ui]),
        ("cuMemHostRegister_v2", [vp, sz, ui]),
        ("cuMemHostUnregister", [vp]),
        ("cuCtxGetCurrent", [ctypes.POINTER(vp)]),
        ("cuCtxSetCurrent", [vp]),
        ("cuDeviceGet", [ctypes.POINTER(ci), ci]),
        ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(vp), ci]),
        ("cuDevicePrimaryCtxRelease", [ci]),
        ("cuDeviceGetAttribute", [ctypes.POINTER(ci), ci, ci]),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ci
    if lib.cuInit(0) != 0:
        return None
    return lib


def _in_primary_context(lib: ctypes.CDLL, index: int, fn: Callable[[], _T]) -> _T:
    """``fn()`` with a context current on this thread: the one already current, else the
    device's primary context for the call."""
    current = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(current)) == 0 and current.value:
        return fn()
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    if lib.cuDeviceGet(ctypes.byref(dev), index) or lib.cuDevicePrimaryCtxRetain(
        ctypes.byref(ctx), dev
    ):
        return fn()  # the driver's own error follows from the call
    try:
        lib.cuCtxSetCurrent(ctx)
        return fn()
    finally:
        lib.cuCtxSetCurrent(None)
        lib.cuDevicePrimaryCtxRelease(dev)


def _device_index(device: torch.device | None) -> int:
    import torch

    if device is not None and device.index is not None:
        return int(device.index)
    return int(torch.cuda.current_device())


def read_only_supported(device: torch.device | None = None) -> bool | None:
    """Whether ``device`` pins read-only mappings (None: no CUDA driver here)."""
    lib = _driver()
    if lib is None:
        return None
    index = _device_index(device)
    dev, value = ctypes.c_int(), ctypes.c_int()
    if lib.cuDeviceGet(ctypes.byref(dev), index) or lib.cuDeviceGetAttribute(
        ctypes.byref(value), _ATTR_READ_ONLY_HOST_REGISTER, dev
    ):
        return None
    return bool(value.value)


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

    def __init__(self, owner: object, address: int, nbytes: int, index: int, what: str) -> None:
        self.owner: object | None = owner
        self.address = address
        self.nbytes = nbytes
        self.what = what
        self._finalizer = weakref.finalize(self, _finish, address, nbytes, index, what)
        self._finalizer.atexit = False  # the process's exit unpins everything anyway

    @classmethod
    def register(
        cls,
        memory: Any,
        *,
        read_only: bool = False,
        what: str = "host memory",
        device: torch.device | None = None,
    ) -> HostRegistration | None:
        """Register the pages of ``memory`` (a CPU tensor or numpy array over host memory: it
        is kept alive while registered) through ``device``'s primary context (default: the
        current device's). None without CUDA, or where the driver refuses (logged once)."""
        import torch

        from sessioncache.devices import host_tensor

        if not torch.cuda.is_available():
            return None
        lib = _driver()
        if lib is None:
            return None
        torch.cuda.init()  # type: ignore[no-untyped-call]
        tensor = host_tensor(memory)
        nbytes = tensor.numel()
        if nbytes == 0:
            return None
        address, index = tensor.data_ptr(), _device_index(device)
        flags = _PORTABLE | (_READ_ONLY if read_only else 0)
        error = _in_primary_context(
            lib, index, lambda: int(lib.cuMemHostRegister_v2(address, nbytes, flags))
        )
        if error:
            with cls._lock:
                cls.refused += 1
                warned, cls._warned = cls._warned, True
            if not warned:
                log.warning(
                    "cuMemHostRegister(%s, %d bytes%s) refused: CUresult %d; copies from it "
                    "are staged through pinned buffers",
                    what,
                    nbytes,
                    ", read-only" if read_only else "",
                    error,
                )
            return None
        with cls._lock:
            first, cls._announced = not cls._announced, True
            cls.registered_bytes += nbytes
        if first:
            log.info(
                "cuMemHostRegister: host memory pinned for CUDA (portable%s), first %s",
                ", read-only" if read_only else "",
                what,
            )
        return cls(memory, address, nbytes, index, what)

    def close(self) -> None:
        """Unregister now (the memory stays mapped while others hold it)."""
        self._finalizer()
        self.owner = None


def _finish(address: int, nbytes: int, index: int, what: str) -> None:
    lib = _driver()
    if lib is not None:
        error = _in_primary_context(lib, index, lambda: int(lib.cuMemHostUnregister(address)))
        if error:
            log.warning("cuMemHostUnregister(%s) failed: CUresult %d", what, error)
    with HostRegistration._lock:
        HostRegistration.registered_bytes -= nbytes
