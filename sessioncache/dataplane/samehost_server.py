"""The node's same-host data path: the stream server on a Unix socket, plus the shared-memory
ops (``docs/dataplane.md``, "Same host").

An engine on the node's host connects to ``<data_dir>/sessioncache.sock`` (mode 0600), says
HELLO with its API key, and is served only if its tenant is trusted
(``SESSIONCACHE_SHM_TRUSTED_TENANTS``; without API keys: the one tenant, and only a peer of the
node's own uid, checked with ``SO_PEERCRED``). Then besides every stream request it may send:

- SEGMENTS: descriptors of the CPU tier's memfd segments, passed with ``SCM_RIGHTS``;
- LOCATE: a LOOKUP whose leased blocks are answered with where they lie in those segments
  (copied there first when held only lower) and their XXH3-64;
- STAGE / COMMIT / ABORT: slots to fill in place, published when their checksums match.

No payload byte crosses the socket. Trusted means trusted: a peer that maps the segments can
read and write every block of every tenant in the CPU tier, whatever the ops answer it.

Crash safety: everything a connection holds, its leases and its staged slots, is released when
it ends, however it ends (a client killed with ``kill -9`` closes its socket in the kernel).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
from collections.abc import Sequence
from concurrent.futures import Executor

from sessioncache.buffers import BufferPool
from sessioncache.config import Settings
from sessioncache.dataplane import frames, ops
from sessioncache.dataplane.errors import AuthRefused, StoreRefused, StreamClosed
from sessioncache.dataplane.frames import (
    DROPPED,
    MAX_FDS,
    PRESENT,
    STORED,
    Header,
    Limits,
    Op,
    SegmentsOk,
    Slot,
)
from sessioncache.dataplane.server import Connection, StreamServer
from sessioncache.dataplane.transport import SocketTransport, Transport, UnixListener
from sessioncache.errors import InvalidInput
from sessioncache.hashing import BlockHash
from sessioncache.node import OPEN_TENANT, CacheNode
from sessioncache.store import PRESENT as STAGE_PRESENT
from sessioncache.store import STAGED, Staging
from sessioncache.tiers.base import SharedMemoryTier

log = logging.getLogger("sessioncache.dataplane.samehost")

MAX_STAGINGS = 1024
"""Stagings one connection may hold open at once."""
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def peer_credentials(transport: Transport) -> tuple[int, int, int] | None:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket (None elsewhere)."""
    if not isinstance(transport, SocketTransport) or transport.socket.family != socket.AF_UNIX:
        return None
    raw = transport.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


class SameHostConnection(Connection):
    """One same-host peer: a stream connection with the shared-memory ops (module doc)."""

    def __init__(
        self,
        node: CacheNode,
        transport: Transport,
        *,
        tier: SharedMemoryTier,
        trusted: frozenset[str],
        limits: Limits,
        timeout_s: float | None,
        idle_timeout_s: float | None,
        buffers: BufferPool,
        putter: Executor,
        load_lease_s: float,
    ) -> None:
        super().__init__(
            node,
            transport,
            limits=limits,
            timeout_s=timeout_s,
            idle_timeout_s=idle_timeout_s,
            buffers=buffers,
            putter=putter,
            load_lease_s=load_lease_s,
        )
        self.tier = tier
        self.trusted = trusted
        self.stagings: dict[bytes, Staging] = {}
        self.credentials = peer_credentials(transport)

    def run(self) -> None:
        """Serve the peer; then abort every staging it left open (never raises)."""
        try:
            if not self.node.auth_enabled and (
                self.credentials is None or self.credentials[1] != os.geteuid()
            ):
                # Open mode trusts its one tenant: only with the node's own user at the other end.
                self._send_error(
                    0,
                    AuthRefused(
                        "this node runs without API keys: same-host peers of its own uid only"
                    ),
                    closing=True,
                )
                self.transport.close()
                return
            super().run()
        finally:
            aborted = 0
            for staging in self.stagings.values():
                try:
                    aborted += self.node.store.abort(staging)
                except Exception:
                    log.exception("same-host connection %s: abort failed", self.transport.peer)
            self.stagings.clear()
            if aborted:
                log.info(
                    "same-host connection %s gone: freed its %d staged slots",
                    self.transport.peer,
                    aborted,
                )

    def _hello(self, header: Header) -> None:
        if self.peer is not None:
            raise InvalidInput("HELLO twice on one connection")
        hello = frames.decode_hello(self._body())
        peer = ops.authenticate(self.node, hello.api_key)
        if peer.tenant not in self.trusted:
            raise AuthRefused(
                f"tenant {peer.tenant!r} is not trusted with the same-host path (it maps every "
                "tenant's blocks): see SESSIONCACHE_SHM_TRUSTED_TENANTS"
            )
        self.peer = peer
        ok = ops.hello_ok(self.node, peer, self.limits)
        self.transport.send([frames.encode_hello_ok(header.request_id, ok)])

    def _dispatch_more(self, header: Header) -> None:
        op = header.opcode
        if op == Op.SEGMENTS:
            self._segments(header)
        elif op == Op.LOCATE:
            self._locate(header)
        elif op == Op.STAGE:
            self._stage(header)
        elif op == Op.COMMIT:
            self._commit(header)
        elif op == Op.ABORT:
            self._abort(header)
        else:
            super()._dispatch_more(header)

    # -- SEGMENTS ------------------------------------------------------------------------

    def _segments(self, header: Header) -> None:
        wanted = frames.decode_segments(self._body())
        live = self.tier.segments()
        alive = set(live)
        sent: list[int] = []
        fds: list[int] = []
        try:
            for segment in dict.fromkeys(wanted):
                if segment not in alive or len(sent) == MAX_FDS:
                    continue
                try:
                    fds.append(self.tier.segment_fd(segment))
                except KeyError:
                    continue  # retired since: not live any more
                sent.append(segment)
            frame = frames.encode_segments_ok(
                header.request_id, SegmentsOk(live[: frames.MAX_SEGMENTS], sent)
            )
            self._send_with_fds(frame, fds)
        finally:
            for fd in fds:
                os.close(fd)

    def _send_with_fds(self, frame: bytes, fds: Sequence[int]) -> None:
        if not fds:
            self.transport.send([frame])
            return
        assert isinstance(self.transport, SocketTransport)
        sock = self.transport.socket
        try:
            sent = socket.send_fds(sock, [frame], list(fds))
            if sent < len(frame):
                sock.sendall(frame[sent:])
        except OSError as exc:
            raise StreamClosed(f"{self.transport.peer}: {exc}") from exc

    # -- LOCATE --------------------------------------------------------------------------

    def _locate(self, header: Header) -> None:
        assert self.peer is not None
        request = frames.decode_locate(self._body(), self.limits, header.flags)
        held, key = ops.leased_lookup(self.node, self.peer, request)
        slots: list[Slot] = []
        if key is not None:
            lease = self.peer.leases[key]
            for found in self.node.store.locate(lease.hashes):
                where = found.location
                slots.append(Slot(where.segment, where.offset, where.nbytes, found.checksum))
        ok = frames.LocateOk(
            key, request.lease_ms if key is not None else 0, len(held.nbytes), slots
        )
        self.transport.send([frames.encode_locate_ok(header.request_id, ok)])

    # -- STAGE, COMMIT, ABORT ------------------------------------------------------------

    def _stage(self, header: Header) -> None:
        assert self.peer is not None
        head = frames.decode_stage_head(self._body(frames.STORE_FIXED), header, self.limits)
        tokens = self._body(head.token_bytes)
        if len(self.stagings) >= MAX_STAGINGS:
            raise InvalidInput(f"this connection holds {MAX_STAGINGS} stagings: commit or abort")
        plan = ops.plan_store(self.node, self.peer, head, tokens)
        staging = self.node.store.stage(
            plan.ids,
            namespace_root=head.root,
            nbytes=head.block_nbytes,
            parent=BlockHash(head.parent) if head.parent is not None else None,
            ttl_s=plan.ttl_s,
            durable=plan.durable,
            parents=None if head.linked else plan.parents,
        )
        key = secrets.token_bytes(16)
        self.stagings[key] = staging
        codes = {STAGED: STORED, STAGE_PRESENT: PRESENT}
        ok = frames.StageOk(
            key,
            plan.durable,
            list(plan.ids),
            [codes.get(status, DROPPED) for status in staging.status],
            [
                Slot(where.segment, where.offset, where.nbytes) if where is not None else None
                for where in staging.locations
            ],
        )
        self.transport.send([frames.encode_stage_ok(header.request_id, ok)])

    def _staging(self, key: bytes) -> Staging:
        staging = self.stagings.get(key)
        if staging is None:
            raise StoreRefused(f"no open staging {key.hex()} on this connection")
        return staging

    def _commit(self, header: Header) -> None:
        commit = frames.decode_commit(self._body(), self.limits)
        staging = self._staging(commit.staging)
        if commit.start != staging.claimed:
            raise InvalidInput(
                f"COMMIT from block {commit.start}; the staging is committed up to "
                f"{staging.claimed}"
            )
        result = self.node.store.commit(staging, commit.checksums, commit.nbytes)
        if not staging.open:
            del self.stagings[commit.staging]
        end = commit.start + len(commit.checksums)
        status = {h: STORED for h in result.stored}
        status.update((h, PRESENT) for h in result.present)
        status.update((h, frames.REJECTED) for h in result.rejected)
        ids = staging.hashes[commit.start : end]
        ok = frames.StoreOk(staging.durable, list(ids), [status.get(h, DROPPED) for h in ids])
        self.transport.send([frames.encode_commit_ok(header.request_id, ok)])

    def _abort(self, header: Header) -> None:
        key = frames.decode_abort(self._body())
        staging = self.stagings.pop(key, None)
        if staging is not None:
            self.node.store.abort(staging)
        self.transport.send([frames.encode_abort_ok(header.request_id)])


class SameHostServer(StreamServer):
    """The stream server on the node's Unix socket, with the same-host ops (module doc)."""

    def __init__(
        self,
        node: CacheNode,
        listener: UnixListener,
        *,
        trusted: Sequence[str],
        limits: Limits | None = None,
        timeout_s: float | None = 30.0,
        max_connections: int = 64,
    ) -> None:
        tier = node.store.shared_memory_tier
        if tier is None:
            raise InvalidInput("the same-host path needs the CPU tier in shared memory")
        super().__init__(
            node, listener, limits=limits, timeout_s=timeout_s, max_connections=max_connections
        )
        self.tier = tier
        self.trusted = frozenset(trusted if node.auth_enabled else [OPEN_TENANT])

    def connection(self, transport: Transport) -> Connection:
        return SameHostConnection(
            self.node,
            transport,
            tier=self.tier,
            trusted=self.trusted,
            limits=self.limits,
            timeout_s=self.timeout_s,
            idle_timeout_s=self.idle_timeout_s,
            buffers=self.buffers,
            putter=self.putter,
            load_lease_s=self.load_lease_s,
        )


def open_samehost_server(node: CacheNode, settings: Settings) -> SameHostServer | None:
    """The same-host server the settings describe, bound (not started); None when the CPU
    tier is not in shared memory (``SESSIONCACHE_SHM`` off, no CPU tier, CUDA, not Linux)."""
    if node.store.shared_memory_tier is None:
        return None
    path = settings.shm_socket_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    if node.auth_enabled and not settings.shm_trusted_tenants:
        log.warning(
            "same-host socket %s: no tenant is trusted (SESSIONCACHE_SHM_TRUSTED_TENANTS), "
            "so every peer will be refused",
            path,
        )
    listener = UnixListener(str(path), mode=0o600)
    return SameHostServer(
        node,
        listener,
        trusted=settings.shm_trusted_tenants,
        limits=Limits(
            max_ids=settings.stream_max_ids,
            max_block_bytes=settings.max_body_bytes,
            max_tokens=settings.max_tokens,
        ),
        timeout_s=settings.stream_timeout_s,
        max_connections=settings.stream_max_connections,
    )
