"""The node's end of the data plane: one thread per connection over blocking sockets.

``StreamServer`` accepts connections from a ``Listener`` (TCP here; a Unix-domain listener
works the same) and runs ``serve_connection`` for each in its own thread. A connection reads
one request frame at a time, answers it completely, then reads the next: a peer that does not
read its answers stalls in the kernel's socket buffers, and so does a node that does not read
a peer's uploads (back-pressure, with no queue in between). Payloads move without Python
copies: a STORE's payloads are received with ``recv_into`` straight into a pooled buffer that
the store copies into its tier; a LOAD sends each block straight from the tier's memory (the
view ``TieredStore.get`` gives, valid while the block is leased).

Errors: an ``ERROR`` frame answers a request that failed; the connection stays usable (the
rest of a refused body is read and dropped first). A frame that breaks the framing, a first
frame that is not a good HELLO, or anything unexpected is answered with an ``ERROR`` frame
flagged closing, and the connection is closed. Either way the leases the connection took are
released when it ends, however it ends.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, ClassVar

from sessioncache.attribution import REASONS, MissReport
from sessioncache.buffers import BufferPool, Filling
from sessioncache.config import Settings
from sessioncache.dataplane import frames
from sessioncache.dataplane.calls import lookup_request, session_call, store_request
from sessioncache.dataplane.frames import Header, Limits, Op, VersionError
from sessioncache.dataplane.transport import (
    Listener,
    TcpListener,
    Transport,
    discard,
    recv_exact,
)
from sessioncache.errors import (
    AuthRefused,
    ErrorCode,
    FrameError,
    InvalidInput,
    QuotaExceeded,
    SessionCacheError,
    StreamClosed,
    stream_code,
)
from sessioncache.hashing import BlockHash
from sessioncache.node import CacheNode
from sessioncache.operations import caller as callers
from sessioncache.operations import lookups, sessions, stores
from sessioncache.operations.caller import Caller
from sessioncache.operations.messages import PrefetchResult
from sessioncache.status import kept

log = logging.getLogger("sessioncache.dataplane")

_SCRATCH = 1 << 20
FRAME_MIN_RATE = 1 << 20
"""Bytes per second a frame's body must at least arrive at, beyond the timeout: a peer that
trickles a byte every few seconds is closed, one on a slow link is not."""


class _Refused(Exception):
    """Ends a connection after its closing ERROR frame was sent."""


class Connection:
    """One peer: the HELLO, then requests answered one by one (see the module docstring).

    ``HANDLERS`` names each opcode's handler, a method called with the request's header
    (``body_len``: what follows the session section) and the session it names: it decodes
    the body, calls the operation layer with the connection's ``Caller``, and encodes the
    answer."""

    HANDLERS: ClassVar[dict[Op, str]] = {}
    CARRIER: ClassVar[str] = "stream"
    """The carrier whose received payload bytes this connection counts (``node.received``)."""

    def __init__(self, server: StreamServer, transport: Transport) -> None:
        self.server = server
        self.key: int | None = None
        """The server's id of this connection (None when run by ``serve``)."""
        self.node = server.node
        self.transport = transport
        self.limits = server.limits
        self.timeout_s = server.timeout_s
        self.idle_timeout_s = server.idle_timeout_s
        self.buffers = server.buffers
        self.putter = server.putter
        self.load_lease_s = server.load_lease_s
        self.caller: Caller | None = None
        self.version = frames.FRAME_VERSION
        """The version its HELLO negotiated."""
        self._header = bytearray(frames.HEADER_SIZE)
        self._left = 0  # body bytes of the current request not read yet
        self._scratch: memoryview | None = None
        self._tier_index = {name: i for i, name in enumerate(self.node.store.tier_names())}

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until the peer leaves or breaks the framing; never raises."""
        try:
            callers.admit(self.node, self.transport.local)
            # the whole HELLO within its deadline, however it trickles in
            self.transport.set_deadline(time.monotonic() + self.server.hello_timeout_s)
            while True:
                header = self._next_header()
                if header is None:
                    return
                self._answer(header)
        except AuthRefused as exc:
            self._send_error(0, exc, closing=True)
        except (_Refused, StreamClosed) as exc:
            log.debug("data-plane connection %s ends: %s", self.transport.peer, exc)
        except Exception:
            log.exception("data-plane connection %s failed", self.transport.peer)
            self._send_error(0, RuntimeError("internal error"), closing=True)
        finally:
            self._drop()
            self.transport.close()

    def _drop(self) -> None:
        if self.caller is None:
            return
        self.server.leave(self.caller.tenant)
        try:
            released, freed = callers.drop(self.node, self.caller)
        except Exception:
            log.exception("data-plane connection %s: cleanup failed", self.transport.peer)
            return
        if released or freed:
            log.info(
                "data-plane connection %s gone: released its %d leases, freed %d staged slots",
                self.transport.peer,
                released,
                freed,
            )

    def _next_header(self) -> Header | None:
        """The next request's header, or None when the peer closed between requests."""
        authenticated = self.caller is not None
        if authenticated:
            self.transport.set_deadline(None)  # between frames: the idle timeout only
        self.transport.set_timeout(self.idle_timeout_s)
        view = memoryview(self._header)
        first = self.transport.recv_into(view)
        if first == 0:
            return None
        started = time.monotonic()
        self.transport.set_timeout(self.timeout_s)
        if authenticated and self.timeout_s is not None:
            self.transport.set_deadline(started + self.timeout_s)
        try:
            recv_exact(self.transport, view[first:])
            header = frames.decode_header(self._header, requests=True)
            frames.check_body(header, self.limits)
            if authenticated and self.timeout_s is not None:
                # a whole frame within the timeout plus its body at FRAME_MIN_RATE
                limit = self.timeout_s + header.body_len / FRAME_MIN_RATE
                self.transport.set_deadline(started + limit)
        except VersionError as exc:
            # answered in the peer's version: an ERROR's layout is the same in all of them
            self._send_error(0, exc, closing=True, version=exc.version)
            raise _Refused(str(exc)) from None
        except FrameError as exc:
            self._send_error(0, exc, closing=True)
            raise _Refused(str(exc)) from None
        self._left = header.body_len
        return header

    def _answer(self, header: Header) -> None:
        rid = header.request_id
        try:
            if self.caller is None and header.opcode != Op.HELLO:
                raise AuthRefused("the first frame of a connection must be HELLO")
            if header.opcode == Op.SESSION and self.version < frames.SESSION_VERSION:
                raise FrameError(
                    f"SESSION is a request of version {frames.SESSION_VERSION}; this connection "
                    f"speaks version {self.version}, as its HELLO negotiated"
                )
            session = self._session(header)
            handler = self.HANDLERS.get(header.opcode)
            if handler is None:
                raise InvalidInput(
                    f"{header.opcode.name} is served on the node's same-host Unix socket only"
                )
            getattr(self, handler)(header._replace(body_len=self._left), session)
            if self._left:
                raise FrameError(f"{self._left} bytes of body left unread")
        except StreamClosed:
            raise
        except (FrameError, AuthRefused) as exc:
            self._send_error(rid, exc, closing=True)
            raise _Refused(str(exc)) from None
        except SessionCacheError as exc:
            # A well-framed request the node refused: drop the rest of its body, answer,
            # and carry on with the next request.
            if self._left:
                discard(self.transport, self._left, self._scratch_view())
                self._left = 0
            self._send_error(rid, exc)

    def _session(self, header: Header) -> str | None:
        """The session a request names in its session section (``F_SESSION``), read off."""
        if not header.flags & frames.F_SESSION or header.opcode not in frames.SESSION_OPS:
            return None
        n = frames.session_len(self._body(frames.SESSION_LEN))
        return frames.decode_session(self._body(n))

    @property
    def _caller(self) -> Caller:
        assert self.caller is not None  # _answer lets only HELLO through without one
        return self.caller

    # -- the ops ---------------------------------------------------------------------------

    def _hello(self, header: Header, session: str | None) -> None:
        if self.caller is not None:
            raise InvalidInput("HELLO twice on one connection")
        hello = frames.decode_hello(self._body())
        try:
            version = frames.negotiate(hello, self.server.versions)
        except VersionError as exc:
            raise FrameError(str(exc)) from None
        caller = callers.authenticate(self.node, hello.api_key)
        self._admit(caller)
        try:
            self.server.enter(self, caller.tenant)
        except QuotaExceeded as exc:  # the tenant holds its most connections: this one ends
            self._send_error(header.request_id, exc, closing=True)
            raise _Refused(str(exc)) from None
        self.caller, self.version = caller, version
        node = self.node
        ok = frames.HelloOk(
            caller.tenant, node.auth_enabled, tuple(node.store.tier_names()), self.limits, version
        )
        self.transport.send([frames.encode_hello_ok(header.request_id, ok)])

    def _admit(self, caller: Caller) -> None:
        """Whether the caller may use this carrier (every tenant may use the stream)."""

    def _resolve(self, header: Header, session: str | None) -> None:
        namespace = frames.decode_resolve(self._body())
        root = lookups.resolve(self.node, self._caller, namespace)
        self.transport.send([frames.encode_resolve_ok(header.request_id, root)])

    def _lookup(self, header: Header, session: str | None) -> None:
        request = frames.decode_lookup(self._body(), self.limits, header.flags, session)
        if request.declined and self.version < frames.DECLINED_VERSION:
            raise InvalidInput(
                f"a declined LOOKUP is a request of version {frames.DECLINED_VERSION}; this "
                f"connection speaks version {self.version}, as its HELLO negotiated"
            )
        found = lookups.lookup(self.node, self._caller, lookup_request(request))
        n = found.match.num_blocks
        ok = frames.LookupOk(
            found.key,
            request.lease_ms if found.key is not None else 0,
            [found.nbytes] * n,
            [self._tier_index[t] for t in found.match.tiers],
            self._miss(found.miss) if request.explain else None,
        )
        self.transport.send([frames.encode_lookup_ok(header.request_id, ok)])

    def _miss(self, miss: MissReport | None) -> frames.Miss:
        # a connection of an older version carries no declined count (it asks no declined
        # lookup, so it has none)
        reasons = REASONS if self.version >= frames.DECLINED_VERSION else REASONS[:4]
        tokens = tuple(miss.tokens.get(r, 0) for r in reasons) if miss else (0,) * len(reasons)
        first = miss.first if miss is not None else None
        if first is None:
            return frames.Miss(None, None, None, None, None, None, None, tokens)
        return frames.Miss(
            REASONS.index(first.reason),
            first.block,
            first.token,
            first.offset,
            self._tier_index.get(first.tier) if first.tier is not None else None,
            first.ago_s,
            frames.MISS_PRESSURES.index(first.pressure) if first.pressure else None,
            tokens,
        )

    def _exists(self, header: Header, session: str | None) -> None:
        request = frames.decode_exists(self._body(), self.limits, header.flags)
        ids = [BlockHash(h) for h in request.ids]
        held = lookups.exists(self.node, self._caller, request.root, ids, counted=request.counted)
        self.transport.send([frames.encode_exists_ok(header.request_id, held)])

    def _session_op(self, header: Header, session: str | None) -> None:
        call = frames.decode_session_call(self._body())
        result = session_call(self.node, self._caller, call)
        if isinstance(result, PrefetchResult):
            body: dict[str, Any] | None = result._asdict()
        else:
            body = sessions.as_json(result) if result is not None else None
        self.transport.send([frames.encode_session_ok(header.request_id, body)])

    def _release(self, header: Header, session: str | None) -> None:
        key = frames.decode_release(self._body())
        if header.flags & frames.F_RELEASE_CHECK:
            live = lookups.release_checked(self.node, self._caller, key)
            self.transport.send([frames.encode_release_ok(header.request_id, live=live)])
            return
        lookups.release(self.node, self._caller, key)
        self.transport.send([frames.encode_release_ok(header.request_id)])

    def _load(self, header: Header, session: str | None) -> None:
        caller = self._caller
        request = frames.decode_load(self._body(), header.flags, self.limits, session)
        if isinstance(request, frames.LoadLease):
            plan = lookups.plan_load_lease(
                self.node,
                caller,
                request.lease,
                request.start,
                request.blocks,
                release=request.release,
                session_id=session,
            )
        else:
            plan = lookups.plan_load_ids(
                self.node,
                caller,
                [BlockHash(h) for h in request.ids],
                lease_s=self.load_lease_s,
                each=request.each,
                session_id=session,
            )
        rid = header.request_id
        send = self.transport.send
        try:
            for block_hash in plan.hashes:
                if block_hash is None:
                    send([frames.block_header(rid, 0, missing=True)])
                    continue
                view, left = lookups.read_block(self.node, plan, block_hash)
                if view is None:
                    send([frames.block_header(rid, 0, missing=True)])
                    continue
                timeout = left if self.timeout_s is None else min(self.timeout_s, left)
                self.transport.set_timeout(timeout)  # never send past the lease
                send([frames.block_header(rid, view.nbytes), view])
            if plan.missing:
                send([frames.block_header(rid, 0, missing=True) * plan.missing])
        finally:
            self.transport.set_timeout(self.timeout_s)
            lookups.finish_load(self.node, caller, plan)

    def _store(self, header: Header, session: str | None) -> None:
        caller = self._caller
        fixed = self._body(frames.STORE_FIXED)
        head = frames.decode_store_head(fixed, header, self.limits, session)
        request = store_request(head, self._body(head.token_bytes))
        plan = stores.plan_store(self.node, caller, request)
        # Two buffers: block i is stored (copied into its tier) by a worker while block i + 1
        # is received; the puts stay in chain order, one at a time. Each grows with the bytes
        # received (a declared size costs nothing until sent), charged to the tenant.
        fillings: list[Filling] = []
        pending: Future[str] | None = None
        received = 0
        with self.node.inflight.charge(caller.tenant) as charge:
            try:
                for index in range(head.blocks):
                    if len(fillings) < 2:
                        fillings.append(Filling(self.buffers, head.block_nbytes, charge))
                    filling = fillings[index % 2]
                    filling.filled = 0
                    self._fill(filling)
                    received += filling.filled
                    if pending is not None:
                        self._stored(pending, index - 1, head.blocks)
                        pending = None
                    pending = self.putter.submit(
                        stores.store_block, self.node, plan, index, filling.buf
                    )
                self._stored(pending, head.blocks - 1, head.blocks)
                pending = None
                stores.settle(self.node, plan)  # a durable STORE: its blocks in one sync
            finally:
                self.node.received.add(self.CARRIER, received)
                if pending is not None:
                    wait([pending])  # its buffer goes back to the pool only once it is done
                self.buffers.give([f.buf for f in fillings if len(f.buf) == f.size])
        status = plan.status
        stores.complete(self.node, caller, plan, kept(status))
        ok = frames.StoreOk(plan.durable, list(plan.ids), status)
        self.transport.send([frames.encode_store_ok(header.request_id, ok)])

    @staticmethod
    def _stored(put: Future[str] | None, index: int, blocks: int) -> None:
        """Wait for block ``index``'s put; its error says which block it was."""
        try:
            if put is not None:
                put.result()
        except SessionCacheError as exc:
            exc.add_note(f"block {index} of {blocks}; the blocks before it stored")
            raise

    # -- body and error plumbing -----------------------------------------------------------

    def _body(self, n: int | None = None) -> bytes:
        """The next ``n`` bytes of the body (default: all of the rest)."""
        n = self._left if n is None else n
        if n > self._left:
            raise FrameError(f"the body is {self._left} bytes short")
        buf = bytearray(n)
        recv_exact(self.transport, memoryview(buf))
        self._left -= n
        return bytes(buf)

    def _fill(self, filling: Filling) -> None:
        """Receive the next ``filling.size`` bytes of the body into ``filling``."""
        while not filling.full:
            with filling.room() as room:
                n = room.nbytes
                self._body_into(room)
            filling.wrote(n)

    def _body_into(self, view: memoryview) -> None:
        if view.nbytes > self._left:
            raise FrameError("the body is shorter than its payloads")
        recv_exact(self.transport, view)
        self._left -= view.nbytes

    def _scratch_view(self) -> memoryview:
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_SCRATCH))
        return self._scratch

    def _send_error(
        self,
        rid: int,
        exc: BaseException,
        *,
        closing: bool = False,
        version: int = frames.FRAME_VERSION,
    ) -> None:
        code = stream_code(exc)
        message = str(exc) if isinstance(exc, SessionCacheError) else "internal error"
        message = "; ".join([message, *getattr(exc, "__notes__", ())])
        if code in (ErrorCode.MALFORMED, ErrorCode.AUTH):
            log.info("data-plane connection %s refused: %s", self.transport.peer, message)
        frame = frames.encode_error(rid, frames.ErrorFrame(code, message, closing), version=version)
        with contextlib.suppress(StreamClosed):
            self.transport.send([frame])


Connection.HANDLERS = {
    Op.HELLO: "_hello",
    Op.RESOLVE: "_resolve",
    Op.LOOKUP: "_lookup",
    Op.LOAD: "_load",
    Op.STORE: "_store",
    Op.RELEASE: "_release",
    Op.EXISTS: "_exists",
    Op.SESSION: "_session_op",
}


class StreamServer:
    """Serves the data plane of ``node`` on ``listener`` (see the module docstring)."""

    def __init__(
        self,
        node: CacheNode,
        listener: Listener,
        *,
        limits: Limits | None = None,
        timeout_s: float | None = 30.0,
        idle_timeout_s: float | None = None,
        max_connections: int = 64,
        advertise: str | None = None,
    ) -> None:
        self.node = node
        self.listener = listener
        self.limits = limits or Limits()
        self.timeout_s = timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self.advertise = advertise or listener.address
        self.versions = frames.VERSIONS
        """The data-plane versions it negotiates in HELLO."""
        self.buffers = BufferPool()
        # Puts of STOREs, overlapping the receipt of the next block (one per connection).
        self.putter = ThreadPoolExecutor(max_connections, thread_name_prefix="dataplane-put")
        # An ids LOAD leases its blocks only while it sends them.
        self.load_lease_s = min(node.settings.max_lease_s, 600.0)
        self.hello_timeout_s = node.settings.stream_hello_timeout_s
        self.max_unauthenticated = min(node.settings.stream_max_unauthenticated, max_connections)
        self._tenants = node.quotas.tally("stream_connections")
        self._lock = threading.Lock()
        self._live: dict[int, tuple[Transport, threading.Thread]] = {}
        self._unauthenticated: dict[int, Transport] = {}  # no HELLO yet, oldest first
        self._stopping = threading.Event()
        self._acceptor: threading.Thread | None = None
        self._ids = iter(range(1, 1 << 62))

    @property
    def address(self) -> str:
        """Where the listener is bound."""
        return self.listener.address

    def connections(self) -> int:
        with self._lock:
            return len(self._live)

    def start(self) -> StreamServer:
        self._acceptor = threading.Thread(
            target=self._accept_loop, name="dataplane-accept", daemon=True
        )
        self._acceptor.start()
        log.info("data plane: stream on %s (advertised as %s)", self.address, self.advertise)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, end every connection (their leases are released), and wait."""
        self._stopping.set()
        self.listener.close()
        if self._acceptor is not None:
            self._acceptor.join(timeout_s)
        with self._lock:
            live = list(self._live.values())
        for transport, _ in live:
            transport.shutdown()
        for _, thread in live:
            thread.join(timeout_s)
        self.putter.shutdown(wait=False)

    def connection(self, transport: Transport) -> Connection:
        return Connection(self, transport)

    def enter(self, connection: Connection, tenant: str) -> None:
        """A connection's HELLO named ``tenant``: counted against the tenant's bound
        (``QuotaExceeded`` past it), and no longer one the server may close for room."""
        self._tenants.admit(tenant)
        if connection.key is not None:
            with self._lock:
                self._unauthenticated.pop(connection.key, None)

    def leave(self, tenant: str) -> None:
        self._tenants.release(tenant)

    def serve(self, transport: Transport) -> None:
        """Run one connection in the calling thread (until it ends)."""
        self.connection(transport).run()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                transport = self.listener.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                log.exception("data plane: accept failed")
                self._stopping.wait(0.1)
                continue
            self._spawn(transport)

    def _spawn(self, transport: Transport) -> None:
        with self._lock:
            # Room for the newcomer: close the oldest connection still without a HELLO when
            # the server is full or holds its most of them (silent sockets never lock it).
            while self._unauthenticated and (
                len(self._live) >= self.max_connections
                or len(self._unauthenticated) >= self.max_unauthenticated
            ):
                old_key = next(iter(self._unauthenticated))
                self._unauthenticated.pop(old_key).shutdown()
                self._live.pop(old_key, None)  # its thread ends on its own
            if self._stopping.is_set() or len(self._live) >= self.max_connections:
                busy = not self._stopping.is_set()
                key = None
            else:
                busy = False
                key = next(self._ids)
        if key is None:
            if busy:
                frame = frames.encode_error(
                    0,
                    frames.ErrorFrame(
                        ErrorCode.BUSY,
                        f"the node serves {self.max_connections} data-plane connections already",
                        True,
                    ),
                )
                try:
                    transport.set_timeout(1.0)
                    transport.send([frame])
                except StreamClosed:
                    pass
            transport.close()
            return
        thread = threading.Thread(
            target=self._run, args=(key, transport), name=f"dataplane-{key}", daemon=True
        )
        with self._lock:
            self._live[key] = (transport, thread)
            self._unauthenticated[key] = transport
        thread.start()

    def _run(self, key: int, transport: Transport) -> None:
        try:
            connection = self.connection(transport)
            connection.key = key
            connection.run()
        finally:
            with self._lock:
                self._live.pop(key, None)
                self._unauthenticated.pop(key, None)


def stream_limits(settings: Settings) -> Limits:
    """What one request may carry on the data plane the settings describe (the stream and
    the same-host socket alike)."""
    return Limits(
        max_ids=settings.stream_max_ids,
        max_block_bytes=settings.max_body_bytes,
        max_tokens=settings.max_tokens,
    )


def open_stream_server(
    node: CacheNode, settings: Settings, *, listen: Callable[[str, int], Listener] = TcpListener
) -> StreamServer | None:
    """The stream server the settings describe, bound (not started); None when disabled."""
    if not settings.stream_enabled:
        return None
    listener = listen(settings.stream_host, settings.stream_port)
    return StreamServer(
        node,
        listener,
        limits=stream_limits(settings),
        timeout_s=settings.stream_timeout_s,
        idle_timeout_s=settings.stream_idle_timeout_s or None,
        max_connections=settings.stream_max_connections,
        advertise=settings.stream_advertise,
    )
