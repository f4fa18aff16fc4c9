"""``StreamConnection``: one data-plane connection (the block stream's or the same-host
socket's) under whichever client speaks over it: request ids, the lock that keeps a request
and its answer together, frames sent and answers read through the sans-IO codec
(``dataplane.frames``), and whether the connection is still usable."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from sessioncache.dataplane import frames
from sessioncache.dataplane.frames import HEADER_SIZE, Header, Limits, Op
from sessioncache.dataplane.transport import Transport, recv_exact
from sessioncache.errors import FrameError, SessionCacheError, StreamClosed, from_stream


class StreamConnection:
    """One data-plane connection, whoever speaks over it: request ids, the lock that keeps a
    request and its answer together, sending frames and reading answers (an ERROR raises the
    exception its code names), and whether the connection is still usable."""

    def __init__(self, transport: Transport, timeout: float | None) -> None:
        self.transport = transport
        transport.set_timeout(timeout)
        self.lock = threading.Lock()
        self.rid = 0
        self.broken: str | None = None
        """Why the connection is unusable (closed, or broken by an error); None while usable."""
        self.head = bytearray(HEADER_SIZE)
        self.scratch: memoryview | None = None
        self.limits = Limits()
        """The node's limits (from HELLO_OK; the defaults until then)."""

    def close(self) -> None:
        self.broken = self.broken or "closed"
        self.transport.close()

    def next_rid(self) -> int:
        self.rid = (self.rid + 1) & ((1 << 64) - 1)
        return self.rid

    def call(
        self,
        op: Op,
        encode: Callable[[int], bytes],
        *,
        payloads: Sequence[memoryview] = (),
    ) -> bytes:
        """Send one request and return the body of its single answer frame."""
        with self.lock:
            rid = self.next_rid()
            self.send(encode(rid), payloads)
            header = self.read_header(rid, frames.ANSWER[op])
            buf = bytearray(header.body_len)
            self.recv(memoryview(buf))
            return bytes(buf)

    def send(self, frame: bytes, payloads: Sequence[memoryview] = ()) -> int:
        if self.broken is not None:
            raise StreamClosed(f"the connection is unusable: {self.broken}")
        try:
            self.transport.send([frame, *payloads])
        except StreamClosed as exc:
            # The node may have refused the connection (BUSY, AUTH) and closed it before our
            # request arrived: its ERROR frame is the better answer, if it is there to read.
            try:
                self.read_header(self.rid, Op.ERROR)
            except (StreamClosed, FrameError):
                pass
            except SessionCacheError as refused:
                self.broken = str(refused)
                raise refused from exc
            self.broken = str(exc)
            raise
        return self.rid

    def read_header(self, rid: int, expect: Op) -> Header:
        self.recv(memoryview(self.head))
        return self.decode_answer_header(self.head, rid, expect)

    def decode_answer_header(self, head: bytearray, rid: int, expect: Op) -> Header:
        """Check an answer's header (read already): an ERROR raises its exception (closing
        the connection when the node did), another opcode or request id is a broken stream."""
        try:
            header = frames.decode_header(head, requests=False)
            frames.check_body(header, self.limits)
        except FrameError as exc:
            self.broken = str(exc)
            raise
        if header.opcode == Op.ERROR:
            buf = bytearray(header.body_len)
            self.recv(memoryview(buf))
            error = frames.decode_error(bytes(buf), header.flags)
            if error.closing:
                self.broken = error.message
                self.transport.close()
            raise from_stream(error.code, error.message)
        if header.opcode != expect or header.request_id != rid:
            self.fail(f"expected {expect.name} for request {rid}, got {header.opcode.name}")
        return header

    def recv(self, view: memoryview) -> None:
        if self.broken is not None:
            raise StreamClosed(f"the connection is unusable: {self.broken}")
        try:
            recv_exact(self.transport, view)
        except (StreamClosed, FrameError) as exc:
            self.broken = f"the connection ended: {exc}"
            self.transport.close()
            raise StreamClosed(self.broken) from None

    def drain(self, n: int) -> None:
        if self.scratch is None:
            self.scratch = memoryview(bytearray(1 << 20))
        while n:
            k = min(n, self.scratch.nbytes)
            self.recv(self.scratch[:k])
            n -= k

    def fail(self, message: str) -> None:
        self.broken = message
        self.transport.close()
        raise FrameError(message)
