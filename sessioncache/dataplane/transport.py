"""The transport seam: a connected byte stream and a listener, whatever carries them.

The node (``server.py``) and the client (``client.py``) move frames through a ``Transport``
only: ``recv_into`` a caller's buffer, ``send`` a list of buffers (headers and payload views,
never joined), a timeout, ``shutdown``/``close``. ``SocketTransport`` implements it over a
TCP or a Unix-domain socket (blocking: the calls release the GIL while the kernel copies);
``TcpListener``/``UnixListener`` accept such connections. Another carrier (an RDMA transport
such as Mooncake's or NIXL's, moving payloads between registered buffers) would implement the
same two protocols and reuse the framing and the op handlers unchanged.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import time
from collections.abc import Sequence
from typing import Final, Protocol, TypeAlias

from sessioncache.errors import FrameError, StreamClosed

Buffer: TypeAlias = bytes | bytearray | memoryview

_IOV_MAX = 512  # buffers per sendmsg call (Linux allows 1024)


class Transport(Protocol):
    """One connected, reliable, ordered byte stream."""

    @property
    def peer(self) -> str:
        """Who is at the other end, for logs."""

    @property
    def local(self) -> bool:
        """Whether the peer runs on this host (loopback or a Unix-domain socket)."""

    def recv_into(self, view: memoryview) -> int:
        """Receive up to ``len(view)`` bytes into ``view``; 0 at the end of the stream."""

    def send(self, parts: Sequence[Buffer]) -> None:
        """Send every byte of ``parts``, in order, within the timeout."""

    def set_timeout(self, seconds: float | None) -> None:
        """Bound each later call (None: wait forever)."""

    def set_deadline(self, at: float | None) -> None:
        """Fail every receive once ``time.monotonic()`` passes ``at`` (None: no deadline),
        however the bytes trickle in: a bound on a whole frame, not on each call."""

    def shutdown(self) -> None:
        """Wake a thread blocked in this transport (from another thread); the stream ends."""

    def close(self) -> None: ...


class Listener(Protocol):
    """Accepts ``Transport`` connections."""

    @property
    def address(self) -> str:
        """Where it listens: ``host:port`` or a socket path."""

    def accept(self) -> Transport:
        """The next connection; raises ``OSError`` once the listener is closed."""

    def close(self) -> None: ...


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, with or without an IPv6 zone, or ``localhost``) names
    this host's loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


class SocketTransport:
    """A ``Transport`` over a connected stream socket (TCP or Unix-domain)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for name, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6)):
                if hasattr(socket, name):  # Linux: a dead peer is noticed within ~2 minutes
                    sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
            host, port = sock.getpeername()[:2]
            peer, local = f"{host}:{port}", is_loopback(str(host))
        else:
            peer, local = f"unix:{sock.getsockname() or '?'}", True
        self.peer: Final = peer
        self.local: Final = local
        self._timeout: float | None = sock.gettimeout()
        self._deadline: float | None = None

    @property
    def socket(self) -> socket.socket:
        return self._sock

    def recv_into(self, view: memoryview) -> int:
        deadline = self._deadline
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StreamClosed(f"{self.peer}: the frame did not arrive in time")
            self._sock.settimeout(left if self._timeout is None else min(left, self._timeout))
        try:
            return self._sock.recv_into(view)
        except TimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                raise StreamClosed(f"{self.peer}: the frame did not arrive in time") from None
            raise StreamClosed(f"{self.peer}: no data for {self._timeout} s") from None
        except OSError as exc:
            raise StreamClosed(f"{self.peer}: {exc}") from exc

    def send(self, parts: Sequence[Buffer]) -> None:
        if self._deadline is not None:
            self._sock.settimeout(self._timeout)  # a receive under a deadline may have cut it
        try:
            if len(parts) == 1:
                self._sock.sendall(parts[0])  # its timeout bounds the whole call
                return
            self._sendmsg_all(parts)
        except TimeoutError:
            raise StreamClosed(
                f"{self.peer}: the peer took nothing for {self._timeout} s"
            ) from None
        except OSError as exc:
            raise StreamClosed(f"{self.peer}: {exc}") from exc

    def _sendmsg_all(self, parts: Sequence[Buffer]) -> None:
        pending = [memoryview(p).cast("B") for p in parts if len(p)]
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        try:
            while pending:
                sent = self._sock.sendmsg(pending[:_IOV_MAX])
                while pending and sent >= pending[0].nbytes:
                    sent -= pending[0].nbytes
                    pending.pop(0)
                if sent:
                    pending[0] = pending[0][sent:]
                if pending and deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    self._sock.settimeout(left)
        finally:
            if deadline is not None:
                self._sock.settimeout(self._timeout)

    def set_timeout(self, seconds: float | None) -> None:
        if seconds != self._timeout or self._deadline is not None:
            self._sock.settimeout(seconds)
            self._timeout = seconds

    def set_deadline(self, at: float | None) -> None:
        if at is None and self._deadline is not None:
            self._sock.settimeout(self._timeout)
        self._deadline = at

    def shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


def recv_exact(transport: Transport, view: memoryview) -> None:
    """Fill ``view``; the stream ending first raises ``FrameError`` (cut short mid-frame)."""
    got = 0
    n = view.nbytes
    while got < n:
        k = transport.recv_into(view[got:])
        if k == 0:
            raise FrameError(f"the stream ended {n - got} bytes short of the frame's end")
        got += k


def read_exact(transport: Transport, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact(transport, memoryview(buf))
    return bytes(buf)


def discard(transport: Transport, n: int, scratch: memoryview) -> None:
    """Read and drop ``n`` bytes (the rest of a refused body) through ``scratch``."""
    while n > 0:
        k = transport.recv_into(scratch[: min(n, scratch.nbytes)])
        if k == 0:
            raise FrameError(f"the stream ended {n} bytes short of the frame's end")
        n -= k


# -- listeners and connecting ----------------------------------------------------------------


class _SocketListener:
    def __init__(self, sock: socket.socket, address: str) -> None:
        self._sock = sock
        self._address = address
        sock.listen(128)

    @property
    def address(self) -> str:
        return self._address

    def accept(self) -> Transport:
        conn, _ = self._sock.accept()
        conn.settimeout(None)
        return SocketTransport(conn)

    def close(self) -> None:
        # shutdown wakes a thread blocked in accept (Linux); close alone may not.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()


class TcpListener(_SocketListener):
    """Listens on ``host:port`` (port 0: a free port, see ``address``)."""

    def __init__(self, host: str, port: int) -> None:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
        except BaseException:
            sock.close()
            raise
        bound = sock.getsockname()
        shown = f"[{bound[0]}]" if family == socket.AF_INET6 else bound[0]
        super().__init__(sock, f"{shown}:{bound[1]}")


class UnixListener(_SocketListener):
    """Listens on a Unix-domain socket at ``path`` (replacing a stale socket file); with
    ``mode`` the socket file has that mode from its creation on (Linux applies a socket's
    own mode at bind), so that only its owner can connect (0o600)."""

    def __init__(self, path: str, *, mode: int | None = None) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if mode is not None:
                os.fchmod(sock.fileno(), mode)
            sock.bind(path)
            if mode is not None:
                os.chmod(path, mode)
        except BaseException:
            sock.close()
            raise
        self._path = path
        super().__init__(sock, path)

    def close(self) -> None:
        super().close()
        with contextlib.suppress(OSError):
            os.unlink(self._path)


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not host:port: {address!r}")
    return host.strip("[]"), int(port)


def connect(address: str, *, timeout: float | None = 30.0) -> SocketTransport:
    """A transport to ``host:port``, ``unix:<path>`` or an absolute Unix socket path."""
    if address.startswith("/"):
        address = f"unix:{address}"
    if address.startswith("unix:"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(address[len("unix:") :])
        except OSError as exc:
            sock.close()
            raise StreamClosed(f"cannot connect to {address}: {exc}") from exc
        return SocketTransport(sock)
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise StreamClosed(f"cannot connect to {address}: {exc}") from exc
    return SocketTransport(sock)
