"""An engine's paged KV cache against a node: its blocks copied straight between the cache's
tensors and the node's buffers, whatever the engine (``connector.vllm`` is the first user).

A paged KV cache holds each attention layer as a tensor with a block dimension. One
sessioncache block is one engine block of every layer, the layers' slices back to back in the
layers' order. ``PagedLayout`` finds from the tensors' shapes and strides where each layer's
slice of a block lies: *runs* of bytes that are contiguous in the cache, one per layer (two
when K and V lead as planes of their own), merged where consecutive layers' slices are
adjacent, as in a block-major layout, where one block of every layer is one run.

Copies move whole runs between precomputed addresses: on the host one ``memmove`` per run
(the GIL released, no array built per run); on a device a ``copy_`` per run, synchronised
before the copy returns, so that a lease on the source is released only after it.

``EngineNode`` is one engine process's side of the node: a data-plane connection per API key,
a counted lookup per request, a leased load straight into the paged blocks (out of the node's
shared memory on the same host, through a reused buffer over the stream; ``connector.ops``'
load loop, the layout's ``scatter`` placing the blocks), on behalf of the request's session
as its lookup and its save are, and a save that gathers the blocks straight into the node's
staging memory (same host) or the stream's frames. Failures follow ``retry.NodeBackoff``.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
import torch

from sessioncache.connector import ops
from sessioncache.connector.payloads import Filler
from sessioncache.connector.retry import NodeBackoff
from sessioncache.connector.samehost import SameHostClient, map_segments
from sessioncache.connector.transfer import DATA_PLANE_PATHS, DEFAULT_LEASE_MS, KVTransfer
from sessioncache.devices import DeviceCopies
from sessioncache.errors import InvalidInput, PayloadSizeError, SessionNotFound
from sessioncache.hashing import Namespace

BlockBytes = npt.NDArray[np.uint8]

_memmove = ctypes.memmove
COPY_THREADS = 2
"""Most threads that copy a load's blocks into the cache (the caller's among them)."""


def default_copy_threads() -> int:
    """``COPY_THREADS``, or fewer where this process may run on fewer cores (vLLM's CPU
    worker binds itself to its cores: threads of its own would share them)."""
    return max(1, min(COPY_THREADS, len(os.sched_getaffinity(0))))


MIN_SHARED_BLOCKS = 8
OPENED_SESSIONS = 65536
"""How many sessions an engine remembers opening on the node (the least recently used are
forgotten first, and opened again, idempotently, if they come back)."""
"""Fewer blocks than this are copied by the caller alone."""


class Run(NamedTuple):
    """One contiguous piece of every block: block ``b``'s bytes ``offset .. offset + length``
    (in the sessioncache block) lie at byte ``start + b * stride`` of ``storage``."""

    storage: torch.Tensor
    """The cache's whole storage as a flat uint8 tensor."""
    start: int
    stride: int
    length: int
    offset: int

    @property
    def base(self) -> int:
        return int(self.storage.data_ptr()) + self.start

    def view(self, num_blocks: int) -> torch.Tensor:
        """The run of every block, ``[num_blocks, length]``."""
        return self.storage.as_strided((num_blocks, self.length), (self.stride, 1), self.start)


def _block_runs(tensor: torch.Tensor, block_dim: int, num_blocks: int) -> list[Run]:
    """``tensor``'s slices of each block, one run per plane before the block dimension (none,
    or K and V); ``offset`` left at 0."""
    size = tensor.shape[block_dim]
    if size % num_blocks:
        raise InvalidInput(f"a block dimension of {size} for {num_blocks} blocks")
    per = size // num_blocks  # kernel blocks per engine block
    storage = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
    item = tensor.element_size()
    out: list[Run] = []
    for plane in [tensor] if block_dim == 0 else list(tensor.unbind(0)):
        first = plane.narrow(0, 0, per)
        if not first.is_contiguous():
            raise InvalidInput(f"a block's slice of a KV tensor {tuple(tensor.shape)} has gaps")
        start = int(plane.storage_offset()) * item
        stride = plane.stride(0) * per * item
        length = first.numel() * item
        if stride < length:
            raise InvalidInput(f"blocks of a KV tensor {tuple(tensor.shape)} overlap")
        out.append(Run(storage, start, stride, length, 0))
    return out


class PagedLayout:
    """Where one engine block lies in the paged KV tensors of a worker (module docstring).
    ``tensors``: the layers' caches in order, each with the block dimension first or second
    after a leading K/V dimension of 2."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        num_blocks: int,
        *,
        copy_threads: int | None = None,
    ) -> None:
        if not tensors or num_blocks <= 0:
            raise InvalidInput("a paged layout needs KV tensors and blocks")
        pieces: list[Run] = []
        devices = {t.device for t in tensors.values()}
        if len(devices) != 1:
            raise InvalidInput(f"KV tensors on several devices: {sorted(map(str, devices))}")
        for name, tensor in tensors.items():
            first = tensor.shape[0] >= num_blocks and tensor.shape[0] % num_blocks == 0
            kv = tensor.dim() > 1 and tensor.shape[0] == 2 and tensor.shape[1] % num_blocks == 0
            if first and kv:
                raise InvalidInput(f"{name}: {tuple(tensor.shape)} is ambiguous for {num_blocks}")
            if not first and not kv:
                raise InvalidInput(f"{name}: no block dimension of {num_blocks} in {tensor.shape}")
            pieces += _block_runs(tensor, 0 if first else 1, num_blocks)
        self.num_blocks = num_blocks
        self.device = pieces[0].storage.device
        self.runs: list[Run] = []
        offset = 0
        for piece in pieces:
            last = self.runs[-1] if self.runs else None
            if (
                last is not None
                and last.storage.data_ptr() == piece.storage.data_ptr()
                and last.stride == piece.stride
                and last.base + last.length == piece.base
            ):  # adjacent in every block (a block-major layout): one run
                self.runs[-1] = last._replace(length=last.length + piece.length)
            else:
                self.runs.append(piece._replace(offset=offset))
            offset += piece.length
        self.nbytes = offset
        """Bytes of one block of every layer (a sessioncache block)."""
        self._host = self.device.type == "cpu"
        self._plan = [(r.base, r.stride, r.length, r.offset) for r in self.runs]
        self._views = [r.view(num_blocks) for r in self.runs]
        threads = default_copy_threads() if copy_threads is None else max(1, copy_threads)
        self.copy_threads = threads if self._host else 1
        self._pool = (
            ThreadPoolExecutor(threads - 1, thread_name_prefix="sessioncache-copy")
            if self.copy_threads > 1
            else None
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def _copy(self, pairs: list[tuple[int, int]], into_cache: bool) -> None:
        """Host copies of whole blocks, ``(block id, buffer address)`` each, run by run;
        shared among the copy threads (``memmove`` releases the GIL) when there are many."""
        if self._pool is None or len(pairs) < MIN_SHARED_BLOCKS:
            _copy_runs(self._plan, pairs, into_cache)
            return
        per = -(-len(pairs) // self.copy_threads)
        parts = [pairs[i : i + per] for i in range(0, len(pairs), per)]
        futures = [self._pool.submit(_copy_runs, self._plan, p, into_cache) for p in parts[1:]]
        try:
            _copy_runs(self._plan, parts[0], into_cache)
        finally:
            for future in futures:
                future.result()  # every copy over before the buffers may go

    def scatter(self, block_ids: Sequence[int], sources: Sequence[BlockBytes]) -> None:
        """Copy ``sources[i]`` (one block each, host memory) into block ``block_ids[i]`` of
        every layer; on a device, synchronised before returning."""
        self._move(block_ids, sources, into_cache=True)

    def gather(self, block_ids: Sequence[int], out: Sequence[BlockBytes]) -> None:
        """Copy block ``block_ids[i]`` of every layer into ``out[i]`` (host memory)."""
        self._move(block_ids, out, into_cache=False)

    def _move(
        self, block_ids: Sequence[int], buffers: Sequence[BlockBytes], *, into_cache: bool
    ) -> None:
        if len(block_ids) != len(buffers):
            raise InvalidInput(f"{len(buffers)} buffers for {len(block_ids)} blocks")
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise InvalidInput(f"block {block_id} is not one of {self.num_blocks}")
        for buf in buffers:
            if buf.dtype != np.uint8 or buf.ndim != 1:
                raise InvalidInput("a block buffer is a flat uint8 array")
            if buf.nbytes != self.nbytes or not buf.flags.c_contiguous:
                raise PayloadSizeError(
                    f"a block of {buf.nbytes} bytes for a layout of {self.nbytes}"
                )
            if not into_cache and not buf.flags.writeable:
                raise InvalidInput("a read-only buffer cannot be gathered into")
        if self._host:
            pairs = [(b, buf.ctypes.data) for b, buf in zip(block_ids, buffers, strict=True)]
            self._copy(pairs, into_cache)
            return
        # On the layout's device's copy stream, complete before the buffers may go (a leased
        # slot released, a staged one committed). A save runs on a thread of its own, whose
        # current stream is not the engine's: the engine's work on the device ends first.
        if not into_cache:
            torch.cuda.synchronize(self.device)
        with DeviceCopies() as copies:
            for block_id, buf in zip(block_ids, buffers, strict=True):
                for run, view in zip(self.runs, self._views, strict=True):
                    piece = buf[run.offset : run.offset + run.length]
                    if into_cache:
                        copies.copy(view[block_id], piece)
                    else:
                        copies.copy(piece, view[block_id])


def _copy_runs(
    plan: list[tuple[int, int, int, int]], pairs: list[tuple[int, int]], into_cache: bool
) -> None:
    """Each run of each block between the cache and its buffer (addresses checked by the
    caller: block ids in range, buffers of the block's size)."""
    for block_id, address in pairs:
        for base, stride, length, offset in plan:
            if into_cache:
                _memmove(base + block_id * stride, address + offset, length)
            else:
                _memmove(address + offset, base + block_id * stride, length)


class BlockCopier(Protocol):
    """What copies sessioncache blocks between an engine's cache and host buffers: a
    ``PagedLayout`` (a target is an engine block id) or several of them side by side
    (``hybrid.GroupedLayout``: a target is one block id per group)."""

    @property
    def nbytes(self) -> int: ...

    @property
    def device(self) -> torch.device:
        """Where the engine's cache lies."""
        ...

    def scatter(self, targets: Sequence[Any], sources: Sequence[BlockBytes]) -> None: ...

    def gather(self, targets: Sequence[Any], out: Sequence[BlockBytes]) -> None: ...


class PagedBlock(Filler):
    """A payload filled in place: the store copies it straight from the paged cache into the
    node's staging memory, or into the frame it sends (``target``: what the copier's
    ``gather`` takes for one block)."""

    __slots__ = ("layout", "target")

    def __init__(self, layout: BlockCopier, target: Any) -> None:
        self.layout = layout
        self.target = target

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def write_into(self, dst: BlockBytes) -> None:
        self.layout.gather([self.target], [dst])


@dataclass(frozen=True, slots=True)
class Scope:
    """What of a request decides where its blocks live: its salt and LoRA (the namespace),
    its session, and its own API key (its tenant; else the engine's)."""

    salt: str | None = None
    lora: str | None = None
    session_id: str | None = None
    api_key: str | None = None


@dataclass(frozen=True, slots=True)
class Transfer:
    """One request's blocks ``first .. first + len(block_ids)`` to load or save: the tokens up
    to their end, and the engine blocks they go to or come from."""

    req_id: str
    tokens: list[int]
    first: int
    block_ids: list[int]
    scope: Scope = Scope()
    finish_reason: str | None = None
    """A save of a finished request of a session: why it finished (``tool_use``, ``stop``,
    ...), sent with its STOREs; with no blocks to save, alone (``finish_session``)."""


class Loaded(NamedTuple):
    """What a load did: blocks loaded (from the first), and seconds spent copying them into
    the cache (the rest of its time went to the node and the carrier)."""

    blocks: int
    copy_s: float


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """How an engine reaches its node."""

    url: str
    api_key: str | None = None
    data_path: str = "auto"
    lease_ms: int = DEFAULT_LEASE_MS
    timeout_s: float = 5.0


class EngineNode:
    """One engine process's data-plane connections to the node: one ``KVTransfer`` per API
    key (the engine's, or a request's own). Calls are serialized by the caller (one
    ``EngineNode`` per thread); the operations are ``connector.ops``'.

    Failures follow the engine side's policy (``retry.NodeBackoff``): a caller that met a
    failure says so (``failure``, or ``failed`` for the node's): after one of the node's the
    connections are closed and the node is ``down`` for a backoff that doubles with each
    failure in a row, so that a node that is dead or silent costs one timeout per backoff,
    not one per request. ``ok`` after a call that succeeded ends the run of failures."""

    def __init__(self, settings: NodeSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.backoff = NodeBackoff(clock=clock)
        self._kvs: dict[str | None, KVTransfer] = {}
        self._sessions: OrderedDict[tuple[str | None, str], None] = OrderedDict()
        """Sessions opened on the node from here, the most recently used last (bounded:
        ``OPENED_SESSIONS``; ``open_session`` is idempotent)."""
        self._bounce = ops.Bounce()

    @property
    def down(self) -> bool:
        """Within the backoff after a failure: callers skip the node (a miss, a dropped save)."""
        return self.backoff.down

    def failed(self) -> float:
        """A call failed for the node's fault: close the connections, back off; the
        backoff's seconds."""
        self.close()
        return self.backoff.failed()

    def ok(self) -> None:
        self.backoff.ok()

    def failure(self, exc: BaseException) -> float | None:
        """A call raised ``exc``: a refusal of the request itself leaves the node up (None);
        anything else is the node's or the carrier's (``failed``: the backoff's seconds)."""
        return self.backoff.failure(exc, self.close)

    def kv(self, scope: Scope) -> KVTransfer:
        key = scope.api_key or self.settings.api_key
        kv = self._kvs.get(key)
        if kv is None:
            s = self.settings
            kv = self._kvs[key] = KVTransfer.from_url(
                s.url,
                api_key=key,
                timeout=s.timeout_s,
                path=s.data_path,  # type: ignore[arg-type]
                paths=DATA_PLANE_PATHS,
                lease_ms=s.lease_ms,
            )
        return kv

    def connect(self, scope: Scope = Scope(), device: torch.device | None = None) -> str:
        """Connect for ``scope`` now, and on the same host map the node's memory ahead of the
        first load (for an engine's cache on a CUDA ``device``, registered with CUDA too);
        the path taken (``same_host`` or ``stream``)."""
        kv = self.kv(scope)
        conn = kv.connection
        if isinstance(conn, SameHostClient):
            map_segments(conn, device)
        return kv.path

    def held_blocks(
        self, namespace: Namespace, tokens: Sequence[int], scope: Scope, *, declined: bool = False
    ) -> int:
        """How many of ``tokens``' full blocks the node holds, from the first: the prompt's
        question, counted as its hit and miss tokens (under its session, opened here the
        first time it is seen). ``declined``: the engine will load nothing; the node counts
        the tokens it holds as missed for that reason (``ops.held``), and this is 0."""
        kv = self.kv(scope)
        root = kv.root(namespace)
        ids = kv.connection.block_hashes(root, tokens)
        return self.held_run(scope, root, ids, declined=declined)

    def held_run(
        self, scope: Scope, root: bytes, ids: Sequence[bytes], *, declined: bool = False
    ) -> int:
        """``held_blocks`` of a chain's ids computed already (``root``: resolved for
        ``scope``)."""
        if not ids:
            return 0

        def ask() -> int:
            with self._in_session(scope):
                kv = self.open_session(scope)
                return ops.held(
                    kv.connection, root, ids, session_id=scope.session_id, declined=declined
                )

        try:
            return ask()
        except SessionNotFound:  # the node closed it since (now forgotten): opened again, once
            return ask()

    def open_session(self, scope: Scope) -> KVTransfer:
        """The connection of ``scope``, its session opened on the node the first time it is
        seen here (``open_session`` is idempotent)."""
        kv = self.kv(scope)
        session = scope.session_id
        if session is None:
            return kv
        key = (scope.api_key, session)
        if key in self._sessions:
            self._sessions.move_to_end(key)
            return kv
        ops.open_session(kv, session)  # or the open one of that id
        self._sessions[key] = None
        if len(self._sessions) > OPENED_SESSIONS:
            self._sessions.popitem(last=False)
        return kv

    @contextmanager
    def _in_session(self, scope: Scope) -> Iterator[None]:
        """A call on behalf of ``scope``'s session: if the node answers that it has no such
        session (it expired, an operator closed it, the node was replaced), forget having
        opened it, so that the next request opens it again instead of failing for good."""
        try:
            yield
        except SessionNotFound:
            self._sessions.pop((scope.api_key, scope.session_id or ""), None)
            raise

    def load(self, namespace: Namespace, transfer: Transfer, layout: PagedLayout) -> Loaded:
        """Load the transfer's blocks into their paged blocks under one lease; how many, from
        the first, were loaded, and the seconds spent copying. On the same host each is copied
        straight out of the node's shared memory; over the stream, through a reused buffer. A
        lease lost during the copies raises ``LeaseLost`` (the blocks copied may be torn: the
        caller recomputes)."""
        kv = self.kv(transfer.scope)
        root = kv.root(namespace)
        first, want = transfer.first, len(transfer.block_ids)
        # The lease covers the chain from its first block (a lookup proves the caller's chain
        # from there); only the blocks from ``first`` on are copied.
        ids = kv.connection.block_hashes(root, transfer.tokens)[: first + want]
        return self.load_ids(transfer.scope, root, ids, first, transfer.block_ids, layout)

    def load_ids(
        self,
        scope: Scope,
        root: bytes,
        ids: Sequence[bytes],
        first: int,
        targets: Sequence[Any],
        layout: BlockCopier,
        *,
        keyed: bool = False,
    ) -> Loaded:
        """Lease ``ids`` (a chain under ``root``, or keyed ids each held on its own) and copy
        those from ``first`` on into ``targets`` (what ``layout.scatter`` takes: engine block
        ids); how many of them, from the first, were loaded (``load``). A chain's load goes
        on behalf of the request's session (its TTL and pins follow the blocks read)."""
        placed = ops.Targets.placed(
            targets[: max(0, len(ids) - first)],
            layout.scatter,
            layout.nbytes,
            self._bounce,
            layout.device,
        )
        with self._in_session(scope):
            got = ops.load(
                self.kv(scope).connection,
                root,
                ids,
                placed,
                lease_ms=self.settings.lease_ms,
                first=first,
                keyed=keyed,
                session_id=None if keyed else scope.session_id,
            )
        return Loaded(got.count(True), placed.copy_s)

    def unsent(self, namespace: Namespace, transfer: Transfer) -> Transfer:
        """``transfer`` past the run of its blocks the node holds already: an uncounted
        EXISTS (no hit nor miss counted, nothing touched nor leased). A session's save keeps
        its last block, whose STORE moves the session's chain and head there."""
        if not transfer.block_ids:
            return transfer
        kv = self.kv(transfer.scope)
        conn = kv.connection
        root = kv.root(namespace)
        end = transfer.first + len(transfer.block_ids)
        ids = conn.block_hashes(root, transfer.tokens[: end * namespace.block_tokens])
        held = conn.exists(root, ids[transfer.first :], counted=False)
        run = held.index(False) if False in held else len(held)
        if transfer.scope.session_id is not None:
            run = min(run, len(held) - 1)
        if not run:
            return transfer
        return replace(transfer, first=transfer.first + run, block_ids=transfer.block_ids[run:])

    def save(self, namespace: Namespace, transfer: Transfer, layout: BlockCopier) -> int:
        """Store the transfer's blocks, gathered from the paged cache straight into the
        carrier's buffers; how many the node holds. A finished request's reason goes with the
        blocks, or alone when there are none (``Transfer.finish_reason``)."""
        kv = self.kv(transfer.scope)
        session = transfer.scope.session_id
        with self._in_session(transfer.scope):
            if not transfer.block_ids:
                if transfer.finish_reason is not None and session is not None:
                    ops.finish_session(kv, session, transfer.finish_reason)
                return 0
            ack = ops.store(
                kv.connection,
                kv.root(namespace),
                transfer.tokens,
                [PagedBlock(layout, b) for b in transfer.block_ids],
                block_tokens=namespace.block_tokens,
                first=transfer.first,
                session_id=session,
                finish_reason=transfer.finish_reason if session is not None else None,
            )
        return sum(ack.held)

    def close(self) -> None:
        kvs, self._kvs = self._kvs, {}
        self._sessions.clear()
        for kv in kvs.values():
            kv.close()
