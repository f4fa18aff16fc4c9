"""The node's same-host data path: the stream server on a Unix socket, plus the shared-memory
ops (``docs/dataplane.md``, "Same host").

An engine on the node's host connects to ``<data_dir>/sessioncache.sock`` (mode 0600), says
HELLO with its API key, and is served only if its tenant is trusted
(``SESSIONCACHE_SHM_TRUSTED_TENANTS``; without API keys: the one tenant, and only a peer of the
node's own uid, checked with ``SO_PEERCRED``). Then besides every stream request it may send:

- SEGMENTS: descriptors of the CPU tier's memfd segments, passed with ``SCM_RIGHTS``;
- LOCATE: a LOOKUP whose leased blocks are answered with where they lie in those segments
  (copied there first when held only lower) and their XXH3-64;
- STAGE / COMMIT / ABORT: slots to fill, in staging memory of this connection alone
  (``dataplane.staging``); a COMMIT copies each into the CPU tier and publishes the copy when
  its checksum matches.

No payload byte crosses the socket. A trusted peer may read every block of every tenant in
the CPU tier, whatever the ops answer it; no peer can change one: the tier's segments are
mapped read-only outside the node.

Crash safety: everything a connection holds, its leases and its staged slots, is released when
it ends, however it ends (a client killed with ``kill -9`` closes its socket in the kernel).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from collections.abc import Sequence

from sessioncache.config import Settings
from sessioncache.dataplane import frames
from sessioncache.dataplane.calls import lookup_request, store_request
from sessioncache.dataplane.frames import MAX_FDS, Header, Limits, Op, SegmentsOk, Slot
from sessioncache.dataplane.server import Connection, StreamServer, stream_limits
from sessioncache.dataplane.staging import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_KEEP_CHUNKS,
    Region,
    StagingMemory,
    staging_spares,
)
from sessioncache.dataplane.transport import SocketTransport, Transport, UnixListener
from sessioncache.errors import AuthRefused, InvalidInput, StreamClosed, TierUnavailable
from sessioncache.node import OPEN_TENANT, CacheNode
from sessioncache.operations import lookups, stores
from sessioncache.operations.caller import Caller
from sessioncache.tiers.base import StagedSlot

log = logging.getLogger("sessioncache.connector.samehost")

_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def peer_credentials(transport: Transport) -> tuple[int, int, int] | None:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket (None elsewhere)."""
    if not isinstance(transport, SocketTransport) or transport.socket.family != socket.AF_UNIX:
        return None
    raw = transport.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


class SameHostConnection(Connection):
    """One same-host peer: a stream connection with the shared-memory ops (module doc). It
    adds only what shared memory needs: descriptor passing, peer credentials, and the
    staging memory its client writes the blocks it stores into; the caller's stagings go with
    it (``Caller``), and so does that memory."""

    CARRIER = "same_host"

    def __init__(self, server: SameHostServer, transport: Transport) -> None:
        super().__init__(server, transport)
        self.tier = server.tier
        self.trusted = server.trusted
        self.credentials = peer_credentials(transport)
        self.staging = StagingMemory(spares=server.staging_spares)
        self._regions: dict[bytes, Region] = {}
        """Each open staging's slots in ``staging``."""

    def run(self) -> None:
        """Serve the peer (never raises); whatever it held goes when it ends."""
        if not self.node.auth_enabled and (
            self.credentials is None or self.credentials[1] != os.geteuid()
        ):
            # Open mode trusts its one tenant: only with the node's own user at the other end.
            self._send_error(
                0,
                AuthRefused("this node runs without API keys: same-host peers of its own uid only"),
                closing=True,
            )
            self.transport.close()
            return
        super().run()

    def _drop(self) -> None:
        try:
            super()._drop()
        finally:
            self._regions.clear()
            self.staging.close()

    def _hello(self, header: Header, session: str | None) -> None:
        super()._hello(header, session)
        # Answered: the first staging chunk is taken while the peer prepares its first request.
        try:
            self.staging.ahead(1)
        except OSError as exc:  # a STAGE tries again, and says why it failed
            log.warning("same-host connection %s: no staging memory ahead: %s", self.key, exc)

    def _admit(self, caller: Caller) -> None:
        if caller.tenant not in self.trusted:
            raise AuthRefused(
                f"tenant {caller.tenant!r} is not trusted with the same-host path (it maps every "
                "tenant's blocks): see SESSIONCACHE_SHM_TRUSTED_TENANTS"
            )

    # -- SEGMENTS ------------------------------------------------------------------------

    def _segments(self, header: Header, session: str | None) -> None:
        wanted = frames.decode_segments(self._body())
        own = self.staging.segments()
        live = [*own, *self.tier.segments()]
        alive = set(live)
        sent: list[int] = []
        fds: list[int] = []
        try:
            for segment in dict.fromkeys(wanted):
                if segment not in alive or len(sent) == MAX_FDS:
                    continue
                try:
                    source = self.staging if segment in own else self.tier
                    fds.append(source.segment_fd(segment))
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

    def _locate(self, header: Header, session: str | None) -> None:
        request = frames.decode_locate(self._body(), self.limits, header.flags, session)
        found, located = lookups.locate(self.node, self._caller, lookup_request(request))
        slots = [
            Slot(f.location.segment, f.location.offset, f.location.nbytes, f.checksum)
            for f in located
        ]
        ok = frames.LocateOk(
            found.key,
            request.lease_ms if found.key is not None else 0,
            found.match.num_blocks,
            slots,
        )
        self.transport.send([frames.encode_locate_ok(header.request_id, ok)])

    # -- STAGE, COMMIT, ABORT ------------------------------------------------------------

    def _stage(self, header: Header, session: str | None) -> None:
        fixed = self._body(frames.STORE_FIXED)
        head = frames.decode_stage_head(fixed, header, self.limits, session)
        request = store_request(head, self._body(head.token_bytes))
        staged = stores.stage(self.node, self._caller, request)
        new = [i for i, slot in enumerate(staged.write.slots) if slot is not None]
        try:
            region = self.staging.take(new, staged.write.nbytes or 1)
        except OSError as exc:
            stores.abort(self.node, self._caller, staged.key)
            raise TierUnavailable(f"no staging memory for {len(new)} blocks: {exc}") from exc
        except BaseException:
            stores.abort(self.node, self._caller, staged.key)
            raise
        self._regions[staged.key] = region
        where = [region.locations.get(i) for i in range(len(staged.write.slots))]
        ok = frames.StageOk(
            staged.key,
            staged.plan.durable,
            list(staged.plan.ids),
            list(staged.status),
            [Slot(w.segment, w.offset, w.nbytes) if w is not None else None for w in where],
        )
        self.transport.send([frames.encode_stage_ok(header.request_id, ok)])

    def _commit(self, header: Header, session: str | None) -> None:
        commit = frames.decode_commit(self._body(), self.limits)
        region = self._regions.get(commit.staging, Region())

        def copy_in(i: int, slot: StagedSlot) -> int:
            return region.copy_out(i, slot.payload)  # the node's own copy is checked

        try:
            staged, status = stores.commit(
                self.node,
                self._caller,
                commit.staging,
                commit.start,
                commit.checksums,
                commit.nbytes,
                copy_in=copy_in,
            )
        finally:
            if commit.staging not in self._caller.stagings:  # committed whole, or failed
                self._give(commit.staging)
        self.node.received.add(self.CARRIER, sum(commit.nbytes))  # the blocks written
        end = commit.start + len(commit.checksums)
        ok = frames.StoreOk(
            staged.plan.durable,
            list(staged.write.hashes[commit.start : end]),
            status,
        )
        self.transport.send([frames.encode_commit_ok(header.request_id, ok)])

    def _abort(self, header: Header, session: str | None) -> None:
        key = frames.decode_abort(self._body())
        stores.abort(self.node, self._caller, key)
        self._give(key)
        self.transport.send([frames.encode_abort_ok(header.request_id)])

    def _give(self, key: bytes) -> None:
        """A staging is over: its staging memory is free."""
        region = self._regions.pop(key, None)
        if region is not None:
            self.staging.give(region)


SameHostConnection.HANDLERS = {
    **Connection.HANDLERS,
    Op.SEGMENTS: "_segments",
    Op.LOCATE: "_locate",
    Op.STAGE: "_stage",
    Op.COMMIT: "_commit",
    Op.ABORT: "_abort",
}


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
        # One STAGE's staging chunks made ahead (fewer for a small CPU tier: a STAGE reserves
        # its slots there), handed to connections as they come.
        chunks = node.settings.cpu_bytes // DEFAULT_CHUNK_BYTES
        self.staging_spares = staging_spares(max(1, min(DEFAULT_KEEP_CHUNKS, chunks)))

    def connection(self, transport: Transport) -> Connection:
        return SameHostConnection(self, transport)

    def start(self) -> SameHostServer:
        super().start()
        self.staging_spares.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        try:
            super().stop(timeout_s)
        finally:
            self.staging_spares.close()


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
        limits=stream_limits(settings),
        timeout_s=settings.stream_timeout_s,
        max_connections=settings.stream_max_connections,
    )
