"""``SameHostClient``: an engine on the node's host copies blocks straight out of the node's
CPU tier and writes new ones straight into it; no payload byte crosses a socket
(``docs/dataplane.md``, "Same host").

    client = SameHostClient.connect("/data/sessioncache.sock", api_key=key)  # or discover(url)
    root = client.resolve(namespace)
    ids = client.block_hashes(root, tokens)
    found = client.locate(root, ids, lease_ms=5000)        # leased, where each block lies
    client.load_into(found, kv_buffers[: found.located])    # copies, then releases
    client.store(root, new_tokens, payloads, parent=ids[found.located - 1])

It is a ``StreamClient`` on the node's Unix socket (RESOLVE, LOOKUP, the stream's LOAD and
STORE all work) whose ``locate``/``load_into`` and ``store`` move payloads through shared
memory: the node passes the descriptors of its memfd segments (``SCM_RIGHTS``), the client maps
them once and copies with numpy. Copies to and from CUDA tensors are asynchronous, on the
tensor's device's copy stream, from mappings the client registers with CUDA the first time a
device copy touches them (``sessioncache.devices``); they are complete before the lease is
released (loads) and before the slots are hashed and committed (stores).

Torn blocks: a located slot is the block's only while the lease pins it. ``load_into`` copies,
then releases the lease asking whether it was still live (``RELEASE`` with ``F_RELEASE_CHECK``);
when it was not, the slot may have been reused during the copy and ``LeaseLost`` is raised: the
caller discards what was copied and looks up again. Without ``release`` the client judges by
its own clock (the lease's term from before the LOCATE was sent). ``verify=True`` also checks
each copy against the block's XXH3-64.

A store stages slots (STAGE), copies each payload in while a thread checksums the payloads
ahead, and commits the filled blocks batch by batch (COMMIT), up to two commits in flight while
the next batch is copied; the node publishes a block only if its slot's bytes match. A client
that dies mid-store leaves nothing half written: the node frees the slots of a connection that
ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import mmap
import os
import socket
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple, Unpack

import numpy as np
import numpy.typing as npt

from sessioncache.connector.connection import StreamConnection
from sessioncache.connector.errors import IdMismatch, ProtocolError
from sessioncache.connector.payloads import Filler, as_buffer, one_size
from sessioncache.connector.stream import (
    HelloOptions,
    StreamClient,
    StreamLookup,
    discover_same_host,
)
from sessioncache.dataplane import frames
from sessioncache.dataplane.frames import (
    HEADER_SIZE,
    MAX_FDS,
    Commit,
    Lookup,
    Op,
    SegmentsOk,
    Slot,
    StageOk,
    StoreHead,
)
from sessioncache.dataplane.slots import copy_and_hash
from sessioncache.dataplane.transport import SocketTransport, Transport
from sessioncache.devices import (
    DeviceCopies,
    cuda_device,
    device_bytes,
    on_device,
)
from sessioncache.errors import (
    ChecksumMismatch,
    InvalidInput,
    LeaseLost,
    PayloadSizeError,
    SessionCacheError,
    StreamClosed,
)
from sessioncache.hashing import payload_checksum
from sessioncache.hostpin import HostRegistration
from sessioncache.status import BlockStatus

if TYPE_CHECKING:
    import torch

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)  # Linux 5.1; not in fcntl

__all__ = [
    "ChecksumMismatch",
    "LeaseLost",
    "SameHostClient",
    "SameHostLookup",
    "map_segments",
    "reading",
    "registered_segments",
]

MiB = 1 << 20
DEFAULT_LEASE_MS = 30_000


class SameHostLookup(NamedTuple):
    """A LOCATE's answer: the leased prefix, and where its first blocks lie."""

    root: bytes
    hashes: list[bytes]
    """The located ids (a prefix of those asked): ``slots[i]`` holds ``hashes[i]``."""
    matched: int
    """Blocks held and leased (the located ones, then any the node could not place)."""
    slots: list[Slot]
    lease: bytes | None
    deadline: float
    """``time.monotonic()`` before which the lease is surely live (measured from before the
    request was sent)."""

    @property
    def located(self) -> int:
        return len(self.hashes)


def _copy_out(dst: Any, src: npt.NDArray[np.uint8], copies: DeviceCopies) -> memoryview | None:
    """Copy ``src`` into the caller's buffer; the host view written (None for a device
    tensor: copied over the mapping straight to the device, on ``copies``)."""
    if on_device(dst):
        copies.copy(device_bytes(dst, src.nbytes), src)
        return None
    view = as_buffer(dst, writable=True)
    if view.nbytes != src.nbytes:
        raise PayloadSizeError(f"a block of {src.nbytes} bytes into a buffer of {view.nbytes}")
    np.copyto(np.frombuffer(view, np.uint8), src)
    return view


def _copy_in(dst: npt.NDArray[np.uint8], payload: Any) -> None:
    """Copy a host payload into a slot (its checksum is taken of the source, ahead, by the
    hashing thread)."""
    np.copyto(dst, np.frombuffer(as_buffer(payload, writable=False), np.uint8))


def _copy_and_hash(dst: npt.NDArray[np.uint8], payload: Any) -> int:
    """Copy a host payload into a slot, hashing the slot's pieces as they are copied
    (``dataplane.slots``): the source is read from memory once. A ``Filler`` fills the slot
    itself, which is hashed after (while it is still in cache)."""
    if isinstance(payload, Filler):
        if payload.nbytes != dst.nbytes:
            raise PayloadSizeError(f"a payload of {payload.nbytes} bytes for a {dst.nbytes} slot")
        payload.write_into(dst)
        return payload_checksum(dst.data)
    return copy_and_hash(dst, np.frombuffer(as_buffer(payload, writable=False), np.uint8))


def _checksum(payload: Any) -> int:
    # with the GIL released: this runs beside the copies of the calling thread
    return payload_checksum(as_buffer(payload, writable=False))


def _stage_frame(rid: int, *, head: StoreHead, tokens: bytes) -> bytes:
    return frames.encode_stage(rid, head, tokens)


class SegmentMaps:
    """The node's shared-memory segments as this client maps them: SEGMENTS asks for the
    descriptors of the ones a slot names, which arrive with the answer over the Unix socket."""

    def __init__(self, conn: StreamConnection, sock: socket.socket) -> None:
        self._conn = conn
        self._sock = sock
        self._segments: dict[int, npt.NDArray[np.uint8]] = {}
        self._registered: dict[int, HostRegistration | None] = {}  # None: refused, or no CUDA
        self._device: torch.device | None = None
        """The CUDA device copies go to once known: segments mapped from then on are
        registered as they are mapped, off the copies' path."""

    @property
    def mapped(self) -> list[int]:
        """The segments mapped here."""
        return sorted(self._segments)

    @property
    def registered(self) -> list[int]:
        """The mapped segments registered with CUDA here."""
        return sorted(s for s, r in self._registered.items() if r is not None)

    def clear(self) -> None:
        for segment in list(self._segments):
            self._forget(segment)

    def _forget(self, segment: int) -> None:
        registration = self._registered.pop(segment, None)
        if registration is not None:
            registration.close()  # before the mapping can go
        self._segments.pop(segment, None)

    def view(self, slot: Slot) -> npt.NDArray[np.uint8]:
        return self._segments[slot.segment][slot.offset : slot.offset + slot.nbytes]

    def register(self, segments: Iterable[int], device: torch.device) -> None:
        """Register the mapped ``segments`` with CUDA for copies to and from ``device`` (once
        each; where the driver refuses, copies from that segment are staged through pinned
        buffers), and every segment mapped from now on as it is mapped."""
        self._device = device
        for segment in segments:
            if segment in self._registered or segment not in self._segments:
                continue
            view = self._segments[segment]
            self._registered[segment] = HostRegistration.register(
                view,
                read_only=not view.flags.writeable,
                what=f"segment {segment}",
                device=device,
            )

    def ensure(self, segments: Iterable[int]) -> None:
        """Map every segment of ``segments`` not mapped yet (SEGMENTS, descriptors passed
        with the answer); forget mappings of segments the node no longer has."""
        missing = sorted({s for s in segments if s not in self._segments})
        while missing:
            ok, fds = self._call(missing)
            try:
                if len(fds) != len(ok.sent):
                    raise ProtocolError(
                        f"SEGMENTS_OK: {len(fds)} descriptors for {len(ok.sent)} ids"
                    )
                for segment, fd in zip(ok.sent, fds, strict=True):
                    self._segments[segment] = self._map(fd)
                if self._device is not None:
                    self.register(ok.sent, self._device)
            finally:
                for fd in fds:
                    os.close(fd)
            live = set(ok.live)
            for segment in [s for s in self._segments if s not in live]:
                self._forget(segment)  # retired: its id never comes back
            still = [s for s in missing if s not in self._segments]
            if still and not ok.sent:
                raise ProtocolError(f"segments {still} are not live on the node")
            missing = still

    @staticmethod
    def _map(fd: int) -> npt.NDArray[np.uint8]:
        """Map a segment: the CPU tier's read-only (the node sealed it against writers), this
        connection's staging memory writable."""
        size = os.fstat(fd).st_size
        sealed = fcntl.fcntl(fd, fcntl.F_GET_SEALS) & (F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_WRITE)
        memory = mmap.mmap(
            fd,
            size,
            flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
            prot=mmap.PROT_READ if sealed else mmap.PROT_READ | mmap.PROT_WRITE,
        )
        return np.frombuffer(memory, np.uint8)

    def ensure_live(self) -> None:
        """Map every segment the node has now (its CPU tier's, this connection's staging)."""
        ok, fds = self._call([])
        for fd in fds:
            os.close(fd)
        self.ensure(ok.live)

    def _call(self, wanted: list[int]) -> tuple[SegmentsOk, list[int]]:
        """SEGMENTS; its answer's first byte carries the descriptors."""
        with self._conn.lock:
            rid = self._conn.send(frames.encode_segments(self._conn.next_rid(), wanted))
            if self._conn.broken is not None:
                raise StreamClosed(f"the connection is unusable: {self._conn.broken}")
            try:
                first, fds, flags, _ = socket.recv_fds(self._sock, 1, MAX_FDS)
            except OSError as exc:
                self._conn.broken = str(exc)
                self._conn.transport.close()
                raise StreamClosed(str(exc)) from None
            try:
                if not first:
                    self._conn.broken = "the node closed the connection"
                    raise StreamClosed(self._conn.broken)
                if flags & socket.MSG_CTRUNC:
                    self._conn.fail("SEGMENTS_OK: descriptors cut short (MSG_CTRUNC)")
                head = bytearray(HEADER_SIZE)
                head[0:1] = first
                self._conn.recv(memoryview(head)[1:])
                header = self._conn.decode_answer_header(head, rid, Op.SEGMENTS_OK)
                body = bytearray(header.body_len)
                self._conn.recv(memoryview(body))
                return frames.decode_segments_ok(bytes(body)), fds
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise


class SameHostClient(StreamClient):
    """A connection to a node's same-host socket (see the module docstring). One client is
    one connection; its calls are serialized (use one client per thread)."""

    _find = staticmethod(discover_same_host)

    client_name = "sessioncache-samehost/1"
    hash_ahead = False
    """Checksum host payloads in a thread of this client, ahead of the copies; by default each
    is hashed piece by piece as it is copied (each piece of the slot while in cache), which
    reads the source once: faster now that the node copies every staged block too (same
    machine, both cores busy; docs/benchmarks.md)."""
    commits_in_flight = 2
    """COMMITs sent whose answers are not awaited yet while the next batch is copied."""
    batch_bytes = 64 * MiB
    """Most bytes copied into slots per COMMIT (a batch the node checks while the next is
    copied)."""
    min_batches = 4
    """A staging is committed in at least this many batches (none under ``min_batch_bytes``),
    so that a small store's copies overlap the node's too."""
    min_batch_bytes = 4 * MiB
    segment_bytes = 256 * MiB
    """Most bytes one STAGE reserves: the node's staging memory for this connection is kept
    at that size between stores (``dataplane.staging``)."""

    def __init__(self, transport: Transport, **options: Unpack[HelloOptions]) -> None:
        if not isinstance(transport, SocketTransport) or transport.socket.family != socket.AF_UNIX:
            transport.close()
            raise InvalidInput("the same-host path runs over the node's Unix socket")
        super().__init__(transport, **options)
        self._maps = SegmentMaps(self._c, transport.socket)
        self._hasher: ThreadPoolExecutor | None = None

    @property
    def mapped_segments(self) -> list[int]:
        """The segments this client has mapped."""
        return self._maps.mapped

    def close(self) -> None:
        self._maps.clear()
        if self._hasher is not None:
            self._hasher.shutdown(wait=False, cancel_futures=True)
        super().close()

    def __repr__(self) -> str:
        return (
            f"SameHostClient({self._c.transport.peer!r}, tenant={getattr(self, 'tenant', None)!r})"
        )

    # -- loads ---------------------------------------------------------------------------

    def locate(
        self,
        root: bytes,
        ids: Sequence[bytes],
        *,
        lease_ms: int = DEFAULT_LEASE_MS,
        keyed: bool = False,
        session_id: str | None = None,
        counted: bool = True,
    ) -> SameHostLookup:
        """Lease the longest held prefix of ``ids`` the caller may read and learn where its
        blocks lie in shared memory (blocks held only lower are copied there first; the
        located run may stop before the leased one where that was not possible). ``keyed``:
        the ids are keyed ids, each held under ``root`` on its own. ``session_id`` and
        ``counted`` as for ``StreamClient.lookup``."""
        self._namespace(root)
        if not ids:
            return SameHostLookup(root, [], 0, [], None, time.monotonic())
        if len(ids) > self._c.limits.max_ids:
            raise InvalidInput(f"{len(ids)} ids; the node takes {self._c.limits.max_ids} at most")
        if lease_ms <= 0:
            raise InvalidInput("a LOCATE needs a lease (lease_ms > 0): it guards the slots")
        request = Lookup(root, list(ids), lease_ms, keyed, session_id, counted)
        start = time.monotonic()
        body = self._c.call(Op.LOCATE, lambda rid: frames.encode_locate(rid, request))
        ok = frames.decode_locate_ok(body)
        if ok.matched > len(ids):
            raise ProtocolError(f"LOCATE_OK: {ok.matched} blocks matched of {len(ids)} asked")
        self._maps.ensure(s.segment for s in ok.slots)
        return SameHostLookup(
            root,
            [bytes(h) for h in ids[: len(ok.slots)]],
            ok.matched,
            ok.slots,
            ok.lease,
            start + lease_ms / 1000,
        )

    def release_checked(self, lease: SameHostLookup | StreamLookup | bytes) -> bool:
        """Release a lease; whether it was still live until now (its blocks never unpinned)."""
        key = lease if isinstance(lease, bytes) else lease.lease
        if key is None:
            return False
        with self._c.lock:
            rid = self._c.send(frames.encode_release(self._c.next_rid(), key, check=True))
            header = self._c.read_header(rid, Op.RELEASE_OK)
            if header.body_len:
                self._c.fail("RELEASE_OK with a body")
            return bool(header.flags & frames.F_RELEASE_LIVE)

    def load_into(
        self,
        source: SameHostLookup | StreamLookup | bytes | Sequence[bytes],
        out: Sequence[Any],
        *,
        start: int = 0,
        release: bool | None = None,
        verify: bool = False,
        each: bool = False,
        session_id: str | None = None,
    ) -> list[bool]:
        """Copy located blocks ``start ..`` of a ``locate`` answer into ``out`` (one exactly
        block-sized buffer each: numpy arrays, CPU tensors pinned or not, CUDA tensors,
        writable buffers); returns which buffers got a block (those past the located run do
        not). Then, by default, releases the lease and raises ``LeaseLost`` if it ran out
        meanwhile (``release=False``: keep it, judged live by this client's clock).
        ``verify`` checks every copy against its XXH3-64 (``ChecksumMismatch``). Other
        sources are loaded over the socket, as ``StreamClient.load_into`` does."""
        if not isinstance(source, SameHostLookup):
            return super().load_into(
                source, out, start=start, release=bool(release), each=each, session_id=session_id
            )
        release = True if release is None else release
        slots = source.slots[start : start + len(out)]
        self._maps.ensure(s.segment for s in slots)
        for dst in out[: len(slots)]:
            device = cuda_device(dst)
            if device is not None:
                self._maps.register((s.segment for s in slots), device)
                break
        copied: list[memoryview | None] = []
        try:
            with DeviceCopies() as copies:  # complete before the lease is released
                for slot, dst in zip(slots, out, strict=False):
                    copied.append(_copy_out(dst, self._maps.view(slot), copies))
        finally:
            live = self.release_checked(source) if release else time.monotonic() < source.deadline
        if not live:
            raise LeaseLost(
                "the lease ran out before the copy ended: the blocks copied may be torn; "
                "look up again"
            )
        if verify:
            for i, (slot, view, dst) in enumerate(zip(slots, copied, out, strict=False)):
                # a device buffer is checked as copied (back to the host): the slot may
                # hold another block by now
                data = (
                    view if view is not None else device_bytes(dst, slot.nbytes).cpu().numpy().data
                )
                if payload_checksum(data) != slot.checksum:
                    raise ChecksumMismatch(f"block {start + i} does not match its checksum")
        return [i < len(slots) for i in range(len(out))]

    def load(
        self,
        source: SameHostLookup | StreamLookup | bytes | Sequence[bytes],
        *,
        blocks: int | None = None,
    ) -> list[bytes | None]:
        """The payloads as new ``bytes`` (for tests and small reads); a ``locate`` answer's
        located blocks are copied from shared memory and its lease released."""
        if not isinstance(source, SameHostLookup):
            return super().load(source, blocks=blocks)
        out = [np.empty(s.nbytes, np.uint8) for s in source.slots]
        self.load_into(source, out, verify=True)
        return [a.tobytes() for a in out]

    # -- stores --------------------------------------------------------------------------

    # -- stores: StreamClient.store and store_keyed, each segment staged, filled, committed --

    def _store_payloads(self, payloads: Sequence[Any]) -> tuple[Sequence[Any], int]:
        """The payloads themselves (numpy arrays, tensors, CUDA ones too, or buffers) are
        copied into their slots: only their one size is checked here."""
        size = one_size(
            (p.numel() * p.element_size())
            if on_device(p)
            else p.nbytes
            if isinstance(p, Filler)
            else as_buffer(p, writable=False).nbytes
            for p in payloads
        )
        return payloads, size

    def _store_segment(
        self, head: StoreHead, segment: bytes, ours: list[bytes], part: Sequence[Any]
    ) -> tuple[list[bytes], list[BlockStatus], bool]:
        """One STAGE, its slots filled and committed: a block is published only if its slot
        holds exactly its bytes (else ``rejected``)."""
        body = self._c.call(Op.STAGE, functools.partial(_stage_frame, head=head, tokens=segment))
        staged = frames.decode_stage_ok(body, head.block_nbytes)
        if staged.ids != ours:
            with contextlib.suppress(SessionCacheError):
                _abort(self._c, staged.staging)
            raise IdMismatch("STAGE: the node derived other ids than the client")
        return staged.ids, self._fill_and_commit(staged, part), staged.durable

    def _fill_and_commit(self, staged: StageOk, payloads: Sequence[Any]) -> list[BlockStatus]:
        """Copy each payload into its slot and commit the filled blocks batch by batch, up to
        ``commits_in_flight`` COMMITs unanswered while the next batch is copied; every block's
        final status.

        The checksums of host payloads are taken of the sources by a thread of this client,
        ahead of the copies (xxhash and numpy both release the GIL), so that hashing, copying
        and the node's verification of the previous batch overlap."""
        self._maps.ensure(s.segment for s in staged.slots if s is not None)
        for payload in payloads:
            device = cuda_device(payload)
            if device is not None:
                self._maps.register((s.segment for s in staged.slots if s is not None), device)
                break
        n = len(staged.ids)
        size = next((s.nbytes for s in staged.slots if s is not None), 1)
        per_batch = min(self.batch_bytes, max(self.min_batch_bytes, n * size // self.min_batches))
        batch = max(1, per_batch // size)
        if self._hasher is None and self.hash_ahead:
            self._hasher = ThreadPoolExecutor(1, thread_name_prefix="samehost-xxh3")
        hashes: list[Future[int] | None] = [
            self._hasher.submit(_checksum, payloads[i])
            if self._hasher is not None
            and staged.slots[i] is not None
            and staged.status[i] is BlockStatus.STORED
            and not on_device(payloads[i])
            and not isinstance(payloads[i], Filler)
            else None
            for i in range(n)
        ]
        codes: list[BlockStatus] = []
        failure: BaseException | None = None
        with self._c.lock:
            inflight: list[int] = []  # COMMITs sent whose answers are not read yet
            try:
                for first in range(0, n, batch):
                    end = min(first + batch, n)
                    lengths: list[int] = []
                    sums: list[int] = []
                    from_device: list[tuple[int, Slot]] = []  # hashed once their copies are done
                    with DeviceCopies() as copies:
                        for i in range(first, end):
                            slot = staged.slots[i]
                            if slot is None or staged.status[i] is not BlockStatus.STORED:
                                lengths.append(0)
                                sums.append(0)
                                continue
                            ahead = hashes[i]
                            dst = self._maps.view(slot)
                            if on_device(payloads[i]):
                                copies.copy(dst, device_bytes(payloads[i], slot.nbytes))
                                from_device.append((len(sums), slot))
                                sums.append(0)
                            elif ahead is None:
                                sums.append(_copy_and_hash(dst, payloads[i]))
                            else:
                                _copy_in(dst, payloads[i])
                                sums.append(ahead.result())
                            lengths.append(slot.nbytes)
                    for k, slot in from_device:
                        sums[k] = payload_checksum(self._maps.view(slot).data)
                    commit = Commit(staged.staging, first, lengths, sums)
                    inflight.append(self._c.send(frames.encode_commit(self._c.next_rid(), commit)))
                    if len(inflight) > self.commits_in_flight:
                        codes += _commit_answer(self._c, inflight.pop(0))
            except BaseException as exc:
                failure = exc
                for pending in hashes:
                    if pending is not None:
                        pending.cancel()
            # Read the answers still due, so that the stream stays in step.
            while inflight and self._c.broken is None:
                try:
                    codes += _commit_answer(self._c, inflight.pop(0))
                except BaseException as exc:
                    failure = failure or exc
        if failure is not None:
            if self._c.broken is None:
                with contextlib.suppress(SessionCacheError):
                    _abort(self._c, staged.staging)  # frees what is left (the node would, at close)
            raise failure
        return codes


def map_segments(client: SameHostClient, device: torch.device | None = None) -> None:
    """Map every segment the node has now, ahead of the loads that will read them (each
    mapping faults in its page tables: an engine does it once, at start); for copies to and
    from a CUDA ``device``, register them with CUDA too."""
    maps = client._maps
    maps.ensure_live()
    if device is not None and device.type == "cuda":
        maps.register(maps.mapped, device)


def registered_segments(client: SameHostClient) -> list[int]:
    """The mapped segments this client registered with CUDA."""
    return client._maps.registered


@contextlib.contextmanager
def reading(
    client: SameHostClient, source: SameHostLookup, device: torch.device | None = None
) -> Iterator[list[npt.NDArray[np.uint8]]]:
    """The located blocks in place: read-only views of their slots in the node's shared
    memory, for a caller that copies them where they go itself (no buffer between): to a
    CUDA ``device``, their segments are registered with CUDA first, and the caller's copies
    must be complete when the block ends. On exit the lease is released, and ``LeaseLost``
    raised if it ran out meanwhile (the copies made may be torn: discard them)."""
    maps = client._maps
    maps.ensure(s.segment for s in source.slots)
    if device is not None and device.type == "cuda":
        maps.register((s.segment for s in source.slots), device)
    views = [maps.view(slot) for slot in source.slots]
    try:
        yield views
    finally:
        views.clear()
        live = client.release_checked(source)
    if not live:
        raise LeaseLost(
            "the lease ran out before the copy ended: the blocks copied may be torn; look up again"
        )


def _commit_answer(conn: StreamConnection, rid: int) -> list[BlockStatus]:
    """Read the COMMIT_OK of request ``rid`` (sent already): each block's status."""
    header = conn.read_header(rid, Op.COMMIT_OK)
    body = bytearray(header.body_len)
    conn.recv(memoryview(body))
    return frames.decode_commit_ok(bytes(body)).status


def _abort(conn: StreamConnection, staging: bytes) -> None:
    conn.call(Op.ABORT, lambda rid: frames.encode_abort(rid, staging))
