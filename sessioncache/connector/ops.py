"""The engine side's operations on a node, once for every adapter: ``KVTransfer`` (by tokens
and by keys), the paged engines' ``EngineNode`` (vLLM), SGLang's HiCache backend and the
LMCache adapters all run their lookups, loads and stores here, and meet failures through one
policy.

A *carrier* is a data-plane connection (``Carrier``: ``StreamClient`` over TCP or
``SameHostClient`` over the node's Unix socket, whose shared memory it reads and writes
directly). The operations:

* the carrier's own ``block_hashes`` / ``key_ids`` (ids by tokens or by 16-byte keys) and
  ``exists``; ``resolve`` (a namespace's root, once per connection), ``held`` (the held run,
  a LOOKUP without a lease), ``release``;
* ``load``: the one locate / load / release loop. It leases the ids (a chain: one request,
  whose lease proves it from its first id; keyed ids: request by request), copies the held
  run (or, for keyed loads that are not a prefix, every held id) into the caller's
  ``Targets``, and releases the lease in every outcome. On the same host the blocks are
  copied straight out of shared memory; over the stream they are received chunk by chunk
  (the last chunk's LOAD releases the lease), straight into the caller's buffers
  (``Targets.buffers``) or through one reused buffer that ``Targets.placed`` scatter from;
* ``load_rest``: the same run over the REST API (lookup, batch GET, release);
* ``store`` (a chain segment after the blocks the node holds) and ``unsent_keyed`` (which
  keyed blocks a store need not send, the node holding them: ``KVTransfer.store_keyed``);
* ``open_session`` / ``finish_session``: the session calls an engine makes besides its loads
  and stores.

Failures meet one policy, ``retry.NodeBackoff``: a request the node refused misses; after a
failure of the node or the carrier, calls miss at once for a backoff, then reconnect.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

from sessioncache.connector.client import SessionCacheClient
from sessioncache.connector.payloads import as_buffer
from sessioncache.connector.protocol import Session
from sessioncache.connector.samehost import SameHostClient, SameHostLookup, reading
from sessioncache.connector.stream import StoreAck, StreamClient, StreamLookup
from sessioncache.dataplane.frames import DECLINED_VERSION, SESSION_VERSION, Limits
from sessioncache.devices import DeviceCopies, device_bytes, is_tensor, on_device, pinned_empty
from sessioncache.errors import InvalidInput, SessionCacheError
from sessioncache.hashing import Namespace, Tokens

if TYPE_CHECKING:
    import torch

BlockBytes = npt.NDArray[np.uint8]

STREAM_CHUNK_BYTES = 32 << 20
"""Most bytes one stream load receives into a reused buffer before they are placed."""


# -- carriers ---------------------------------------------------------------------------------


Carrier: TypeAlias = StreamClient
"""A data-plane connection: a ``StreamClient``, or its same-host subclass ``SameHostClient``,
whose ``locate`` leases blocks in shared memory for its ``load_into`` to copy from there."""


class Endpoint(Protocol):
    """An adapter's way to its node: the REST client beside the data-plane connection
    (``KVTransfer``)."""

    client: SessionCacheClient

    @property
    def carrier(self) -> StreamClient | None:
        """The data-plane connection in use (connecting on first use); None on REST."""


# -- targets ----------------------------------------------------------------------------------


Place = Callable[[Sequence[Any], Sequence[BlockBytes]], None]
"""Copies host blocks (``views[i]``, read-only) into ``targets[i]``, complete on return."""


class Bounce:
    """One reused host buffer (pinned where CUDA is present) that stream loads receive into
    before their blocks are placed; one per thread of loads."""

    def __init__(self) -> None:
        self._buffer: BlockBytes | None = None

    def blocks(self, nbytes: int, count: int) -> list[BlockBytes]:
        """``count`` block buffers of ``nbytes`` each, in the one allocation."""
        need = nbytes * count
        if self._buffer is None or self._buffer.nbytes < need:
            self._buffer = pinned_empty(max(need, STREAM_CHUNK_BYTES)).numpy()
        buffer = self._buffer
        return [buffer[i * nbytes : (i + 1) * nbytes] for i in range(count)]


class Targets:
    """Where a load's blocks go, one target per id loaded, in order: ``Targets.buffers``, the
    caller's own block-sized buffers, which the carrier copies and receives into itself; or
    ``Targets.placed``, targets that a ``place(targets, views)`` callback fills from host
    memory (an engine's block ids and its layout's ``scatter``): on the same host from the
    leased slots in place, over the stream from a reused ``Bounce`` buffer,
    ``STREAM_CHUNK_BYTES`` at most at a time. ``copy_s``: the seconds spent placing."""

    def __init__(
        self,
        targets: Sequence[Any],
        place: Place | None = None,
        nbytes: int = 0,
        bounce: Bounce | None = None,
        device: torch.device | None = None,
    ) -> None:
        if place is not None and (nbytes <= 0 or bounce is None):
            raise InvalidInput("placed targets need their block size and a bounce buffer")
        self.targets = targets
        self.place = place
        self.nbytes = nbytes
        self.bounce = bounce or Bounce()
        self.device = device
        """Where placed targets lie (shared memory is registered with CUDA for copies to a
        CUDA device)."""
        self.copy_s = 0.0

    @classmethod
    def buffers(cls, out: Sequence[Any]) -> Targets:
        """One exactly block-sized buffer per block: numpy arrays, CPU or CUDA tensors,
        writable buffers."""
        return cls(out)

    @classmethod
    def placed(
        cls,
        targets: Sequence[Any],
        place: Place,
        nbytes: int,
        bounce: Bounce,
        device: torch.device | None = None,
    ) -> Targets:
        return cls(targets, place, nbytes, bounce, device)

    def __len__(self) -> int:
        return len(self.targets)

    def per(self, limits: Limits) -> int:
        """Most blocks one stream LOAD receives."""
        if self.place is None:
            return limits.max_ids
        return max(1, min(limits.max_ids, STREAM_CHUNK_BYTES // self.nbytes))

    def _place(self, targets: Sequence[Any], views: Sequence[BlockBytes]) -> None:
        if self.place is None or not targets:
            return
        start = time.perf_counter()
        try:
            self.place(targets, views)
        finally:
            self.copy_s += time.perf_counter() - start

    def from_shared_memory(
        self, carrier: SameHostClient, found: SameHostLookup, start: int, at: int
    ) -> None:
        """Copy ``found``'s located blocks ``start ..`` into targets ``at ..``, then release
        its lease (also on failure; ``LeaseLost`` when it ran out meanwhile)."""
        n = found.located - start
        if self.place is None:
            carrier.load_into(found, self.targets[at : at + n], start=start)
            return
        with reading(carrier, found, self.device) as views:
            self._place(self.targets[at : at + n], views[start : start + n])

    def receive(
        self,
        carrier: Carrier,
        source: StreamLookup | Sequence[bytes],
        at: int,
        count: int,
        *,
        start: int = 0,
        release: bool = False,
        each: bool = False,
    ) -> list[bool]:
        """A stream LOAD of ``count`` blocks of ``source`` (a lease from its block ``start``,
        or ids) into targets ``at ..``; which arrived (``Carrier.load_into``). Placed targets
        get the run from the first, or with ``each`` every block that arrived."""
        if self.place is None:
            out = self.targets[at : at + count]
            return carrier.load_into(source, out, start=start, release=release, each=each)
        buffers = self.bounce.blocks(self.nbytes, count)
        got = carrier.load_into(source, buffers, start=start, release=release, each=each)
        keep = [i for i in (range(count) if each else range(_run(got))) if got[i]]
        self._place([self.targets[at + i] for i in keep], [buffers[i] for i in keep])
        return got

    def put(self, index: int, payload: bytes) -> None:
        """A payload that arrived whole (over REST) into target ``index``."""
        if self.place is not None:
            self._place([self.targets[index]], [np.frombuffer(payload, np.uint8)])
            return
        dst = self.targets[index]
        if on_device(dst):  # on its copy stream, done before this returns
            with DeviceCopies() as copies:
                copies.copy(device_bytes(dst, len(payload)), memoryview(payload))
            return
        view = as_buffer(dst, writable=True)
        if view.nbytes != len(payload):
            raise InvalidInput(f"a {len(payload)}-byte block for a {view.nbytes}-byte buffer")
        view[:] = payload


def _run(found: Sequence[bool]) -> int:
    """How many of ``found``, from the first, are True."""
    return found.index(False) if False in found else len(found)


# -- ids, lookups ----------------------------------------------------------------------------


def resolve(carrier: Carrier, roots: dict[Namespace, bytes], namespace: Namespace) -> bytes:
    """The caller's root of ``namespace`` on ``carrier``: a RESOLVE the first time, kept in
    ``roots`` (the connection's) after; with an API key it carries the tenant's salt."""
    root = roots.get(namespace)
    if root is None:
        root = roots[namespace] = carrier.resolve(namespace)
    return root


def held(
    carrier: Carrier,
    root: bytes,
    ids: Sequence[bytes],
    *,
    keyed: bool = False,
    counted: bool = True,
    session_id: str | None = None,
    declined: bool = False,
) -> int:
    """How many of ``ids``, from the first, the node holds: a LOOKUP without a lease (it also
    finds blocks in a fleet's shared tier). A chain is asked in one request (its first
    ``max_ids`` ids); keyed ids request by request, up to the first miss. ``declined``: the
    caller will load nothing; one declined LOOKUP (its first ``max_ids`` ids) tells the node
    so, which counts the tokens it holds as missed for that reason; 0 (nothing is asked of a
    node too old for it, data-plane version 3 or before)."""
    per = carrier.limits.max_ids
    if declined:
        if carrier.version >= DECLINED_VERSION and ids:
            carrier.lookup(root, ids[:per], keyed=keyed, session_id=session_id, declined=True)
        return 0
    if not keyed:
        ids = ids[:per]
    found = 0
    for first in range(0, len(ids), per):
        part = ids[first : first + per]
        answer = carrier.lookup(root, part, keyed=keyed, counted=counted, session_id=session_id)
        found += answer.matched
        if answer.matched < len(part):
            break
    return found


def release(carrier: Carrier, lease: StreamLookup | SameHostLookup) -> None:
    """End a lease whose blocks were not loaded (nothing when there is none)."""
    if lease.lease is None:
        return
    if isinstance(carrier, SameHostClient):
        carrier.release_checked(lease)
    else:
        carrier.release(lease.lease)


def _release_quietly(carrier: Carrier, lease: StreamLookup | SameHostLookup) -> None:
    """``release`` after a failure (where it cannot reach the node the lease expires)."""
    if not carrier.broken:
        with contextlib.suppress(SessionCacheError, OSError):
            release(carrier, lease)


# -- loads -----------------------------------------------------------------------------------


def load(
    carrier: Carrier,
    root: bytes,
    ids: Sequence[bytes],
    targets: Targets,
    *,
    lease_ms: int,
    first: int = 0,
    keyed: bool = False,
    prefix: bool = True,
    counted: bool = False,
    session_id: str | None = None,
) -> list[bool]:
    """Load ``ids[first:]`` into ``targets`` (one each); which were loaded.

    A chain is leased in one request from its first id (the lease proves the chain; the
    blocks from ``first`` on are copied) and its held run is loaded; ``counted`` and
    ``session_id`` go with that request. Keyed ids (``keyed``) go request by request, each
    request's held blocks loaded (with ``prefix``: none past the first miss, and no request
    past the one that met it); a miss leaves its target alone. On the same host a keyed
    LOCATE answers the run held from its first id: after a miss it locates again past it,
    and blocks held but not placeable in shared memory now go over the socket. Over the
    stream, keyed ids are loaded as asked, every held one sent (one request each, no
    lookup)."""
    want = max(0, len(ids) - first)
    if len(targets) != want:
        raise InvalidInput(f"{len(targets)} targets for {want} blocks")
    if not want:
        return []
    got = [False] * want
    if not keyed:
        n = _leased_run(carrier, root, ids, first, targets, lease_ms, counted, session_id)
        got[:n] = [True] * n
        return got
    shared = carrier if isinstance(carrier, SameHostClient) else None
    per = carrier.limits.max_ids if shared is not None else targets.per(carrier.limits)
    pos = first
    while pos < len(ids):
        part = ids[pos : pos + per]
        at, end = pos - first, pos - first + len(part)
        if shared is None:
            found = targets.receive(carrier, part, at, len(part), each=True)
            got[at:end] = found
            if prefix and not all(found):
                break
            pos += len(part)
            continue
        n, matched = _located_run(shared, root, part, 0, targets, at, lease_ms, keyed=True)
        got[at : at + n] = [True] * n
        if matched > n:
            # held, but not placeable in shared memory now: the rest of the part over the
            # socket (every held id of it, each on its own)
            rest = targets.receive(carrier, part[n:], at + n, len(part) - n, each=True)
            got[at + n : end] = rest
            if prefix and not all(rest):
                break
            pos += len(part)
        elif n < len(part):
            if prefix:
                break
            pos += n + 1  # ids[pos + n] is not held
        else:
            pos += n
    if prefix:
        n = _run(got)
        got[n:] = [False] * (want - n)
    return got


def _leased_run(
    carrier: Carrier,
    root: bytes,
    ids: Sequence[bytes],
    first: int,
    targets: Targets,
    lease_ms: int,
    counted: bool,
    session_id: str | None,
) -> int:
    """Lease the chain ``ids`` in one request and load its held run from ``first`` into the
    targets; how many were loaded. The lease ends in every outcome: released by the last
    chunk's LOAD over the stream."""
    if isinstance(carrier, SameHostClient):
        n, _ = _located_run(
            carrier, root, ids, first, targets, 0, lease_ms, counted=counted, session=session_id
        )
        return n
    found = carrier.lookup(root, ids, lease_ms=lease_ms, counted=counted, session_id=session_id)
    n = max(0, found.matched - first)
    if not n:
        release(carrier, found)
        return 0
    per = targets.per(carrier.limits)
    done = 0
    released = False
    try:
        while done < n:
            count = min(per, n - done)
            released = done + count >= n
            loaded = targets.receive(
                carrier, found, done, count, start=first + done, release=released
            )
            got = _run(loaded)
            done += got
            if got < count:  # gone under the lease (the node lost it): the rest recomputes
                break
    finally:
        if not released:
            _release_quietly(carrier, found)
    return done


def _located_run(
    carrier: SameHostClient,
    root: bytes,
    ids: Sequence[bytes],
    first: int,
    targets: Targets,
    at: int,
    lease_ms: int,
    *,
    keyed: bool = False,
    counted: bool = False,
    session: str | None = None,
) -> tuple[int, int]:
    """A LOCATE of ``ids`` and the copy of its located run from ``first`` out of shared
    memory into targets ``at ..``: how many were copied, and how many of ``ids`` from
    ``first`` the node holds (leased; those past the located run are not placeable in shared
    memory now). The lease ends in every outcome."""
    found = carrier.locate(
        root, ids, lease_ms=lease_ms, keyed=keyed, counted=counted, session_id=session
    )
    n = max(0, found.located - first)
    if n:
        targets.from_shared_memory(carrier, found, first, at)
    elif found.lease is not None:
        carrier.release_checked(found)
    return n, max(0, found.matched - first)


def load_rest(
    client: SessionCacheClient,
    tokens: Tokens,
    targets: Targets,
    *,
    lease_ms: int,
    session_id: str | None = None,
) -> int:
    """``load`` over the REST API: the held prefix of ``tokens``' full blocks (a counted
    lookup, leased), read in one batch GET into the first targets; how many were loaded."""
    found = client.lookup(tokens, session_id=session_id, lease_ms=lease_ms)
    hashes = found.hashes[: len(targets)]
    try:
        payloads = client.load(hashes) if hashes else []
    finally:
        if found.lease is not None:
            client.release(found.lease.id)
    n = 0
    for payload in payloads:
        if payload is None:
            break
        targets.put(n, payload)
        n += 1
    return n


# -- stores ----------------------------------------------------------------------------------


def store(
    carrier: Carrier,
    root: bytes,
    tokens: Tokens,
    payloads: Sequence[Any],
    *,
    block_tokens: int,
    first: int = 0,
    ttl_s: float | None = None,
    session_id: str | None = None,
    durable: bool = False,
    finish_reason: str | None = None,
) -> StoreAck:
    """Store one payload per full block of ``tokens`` (``block_tokens`` each) from block
    ``first`` on: the blocks before it are held, the last of them the new blocks' parent;
    the node derives every id and skips those it holds. ``tokens`` end where the payloads'
    blocks do."""
    parent = carrier.block_hashes(root, tokens[: first * block_tokens])[-1] if first else None
    return carrier.store(
        root,
        tokens[first * block_tokens :],
        payloads,
        parent=parent,
        ttl_s=ttl_s,
        session_id=session_id,
        durable=durable,
        finish_reason=finish_reason,
    )


def unsent_keyed(carrier: Carrier, root: bytes, ids: Sequence[bytes]) -> list[bool]:
    """Which of ``ids`` a keyed store need not send, the node holding them: an uncounted
    EXISTS where the payloads would cross the socket (the stream); on the same host none is
    asked (the STAGE answers held blocks present, and nothing is copied for them)."""
    if isinstance(carrier, SameHostClient):
        return [False] * len(ids)
    return carrier.exists(root, ids, counted=False)


def payload_nbytes(payload: Any) -> int:
    """A payload's size in bytes (a device tensor's without copying it to the host)."""
    if is_tensor(payload):
        return int(payload.numel() * payload.element_size())
    return as_buffer(payload, writable=False).nbytes


# -- sessions --------------------------------------------------------------------------------


def open_session(node: Endpoint, session_id: str) -> Session:
    """Open the caller's session ``session_id`` on the node (or get the open one of that id):
    a SESSION request on the data-plane connection (``_sessions``)."""
    return _sessions(node).open_session(session_id)


def finish_session(node: Endpoint, session_id: str, reason: str) -> Session:
    """The session's latest request finished, for ``reason``, with no store to carry it."""
    return _sessions(node).finish_session(session_id, reason)


def hint_session(
    node: Endpoint, session_id: str, hint: Mapping[str, Any], block_tokens: int | None = None
) -> Session:
    """An agent hint for the session (``agenthints``), on the data-plane connection."""
    return _sessions(node).hint_session(session_id, hint, block_tokens=block_tokens)


def _sessions(node: Endpoint) -> StreamClient | SessionCacheClient:
    """Where an engine's session calls go: its data-plane connection, so that an engine on
    the stream or the same host needs no REST call; the REST client only on the REST path or
    to a node too old for SESSION requests (data-plane version 2)."""
    carrier = node.carrier
    if carrier is not None and carrier.version >= SESSION_VERSION:
        return carrier
    return node.client
