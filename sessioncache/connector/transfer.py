"""KV payloads between an engine and a node by the fastest path the two have.

Three paths, fastest first (docs/dataplane.md):

* ``same_host``: blocks copied straight out of (and into) the node's CPU tier in shared memory,
  through the Unix socket the node names in ``GET /v1/dataplane`` (``SameHostClient``); taken
  when that socket exists on this host and the caller's tenant is trusted with it;
* ``stream``: the binary block stream over TCP (``StreamClient``);
* ``rest``: the HTTP API (batch GET, two-phase store), which every node serves.

``KVTransfer(client)`` picks the first path that connects (``path="auto"``); the ``path``
argument or ``SESSIONCACHE_DATA_PATH`` forces one, and ``paths`` narrows what ``auto`` tries
(``DATA_PLANE_PATHS``: never REST). ``KVTransfer.from_url(url, ...)`` builds the REST client
too. A connection found broken is replaced (the path chosen again) by the next operation.

Two ways to name blocks:

* by tokens (``load_into``, ``store_from``): the chain of the client's namespace. A session
  named in a load or a store travels with it on every path (its TTL, chain pins, head and token
  totals; no REST call on the side);
* by 16-byte block keys (``hashing.block_key`` of an engine's own key; keyed blocks,
  docs/dataplane.md), as LMCache and SGLang address KV: ``exists_keyed``, ``held_prefix_keyed``,
  ``load_keyed``, ``store_keyed``, each in a namespace the caller names. These need the stream or
  the same-host path (the REST API has no keyed blocks).

The lookups, loads and stores themselves are ``connector.ops``' (one locate / load / release
loop for every engine adapter). One ``KVTransfer`` holds one data-plane connection: use one per
thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, cast

import numpy as np

from sessioncache.connector import ops
from sessioncache.connector.client import DEFAULT_TIMEOUT_S, SessionCacheClient
from sessioncache.connector.errors import TransportError
from sessioncache.connector.ops import payload_nbytes
from sessioncache.connector.payloads import as_buffer
from sessioncache.connector.stream import StoreAck, StreamClient
from sessioncache.errors import InvalidInput, SessionCacheError, StoreRefused
from sessioncache.hashing import Namespace, Tokens, tokens_to_le_bytes
from sessioncache.status import BlockStatus

log = logging.getLogger("sessioncache.connector.transfer")

Path = Literal["same_host", "stream", "rest"]
PATHS: tuple[Path, ...] = ("same_host", "stream", "rest")
DATA_PLANE_PATHS: tuple[Path, ...] = ("same_host", "stream")
"""The paths that carry keyed blocks (``paths=DATA_PLANE_PATHS``: never fall back to REST)."""
PATH_ENV = "SESSIONCACHE_DATA_PATH"
DEFAULT_LEASE_MS = 30_000
KEYED_ONLY = Namespace("sessioncache-keyed", 1, "raw", "raw")
"""The REST client's namespace of a ``from_url`` transfer given none (keyed operations only)."""


class Transferred(NamedTuple):
    """What one load or store moved, and how fast."""

    path: Path
    blocks: int
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class KVTransfer:
    """Loads into and stores from the caller's buffers over the fastest path (module doc)."""

    def __init__(
        self,
        client: SessionCacheClient,
        *,
        path: Path | Literal["auto"] | None = None,
        lease_ms: int = DEFAULT_LEASE_MS,
        paths: Sequence[Path] = PATHS,
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ) -> None:
        order = tuple(paths)
        if not order or any(p not in PATHS for p in order) or len(set(order)) != len(order):
            raise InvalidInput(f"paths must be distinct paths of {PATHS}, got {paths!r}")
        wanted = path or os.environ.get(PATH_ENV) or "auto"
        if wanted != "auto" and wanted not in order:
            raise InvalidInput(f"path must be auto or one of {order}, got {wanted!r}")
        self.client = client
        self.wanted = wanted
        self.paths = order
        self.lease_ms = lease_ms
        self.timeout = timeout
        self._conn: StreamClient | None = None
        self._path: Path | None = None
        self._roots: dict[Namespace, bytes] = {}
        self._owns_client = False
        self._by_tokens = True

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        api_key: str | None = None,
        namespace: Namespace | None = None,
        seed: int = 0,
        timeout: float = DEFAULT_TIMEOUT_S,
        path: Path | Literal["auto"] | None = None,
        paths: Sequence[Path] = PATHS,
        lease_ms: int = DEFAULT_LEASE_MS,
    ) -> KVTransfer:
        """A transfer with its own REST client of the node at ``url`` (closed with it).
        ``namespace`` is the one of loads and stores by tokens; without it, the transfer does
        keyed operations only. ``seed``: the node's ``SESSIONCACHE_HASH_SEED``."""
        client = SessionCacheClient(
            url, namespace=namespace or KEYED_ONLY, api_key=api_key, seed=seed, timeout=timeout
        )
        try:
            kv = cls(client, path=path, lease_ms=lease_ms, paths=paths, timeout=timeout)
        except BaseException:
            client.close()
            raise
        kv._owns_client = True
        kv._by_tokens = namespace is not None
        return kv

    @property
    def path(self) -> Path:
        """The path in use (connecting on first use, and again after the connection broke)."""
        if self._conn is not None and self._conn.broken:
            self.disconnect()
        if self._path is None:
            self._path, self._conn = self._connect()
        return self._path

    @property
    def carrier(self) -> StreamClient | None:
        """The data-plane connection in use (connecting on first use); None on the REST
        path."""
        self.path  # noqa: B018 - connects (or reconnects) on first use
        return self._conn

    @property
    def connection(self) -> StreamClient:
        """The data-plane connection (same host or stream; connecting on first use): for
        callers that place the blocks themselves. Raises where the path is REST."""
        return self._dataplane("connection")

    @property
    def connected(self) -> bool:
        """A path is chosen and its connection is usable (else the next operation connects)."""
        return self._path is not None and (self._conn is None or not self._conn.broken)

    def disconnect(self) -> None:
        """Close the data-plane connection; the next operation connects again (choosing the
        path again)."""
        conn, self._conn, self._path = self._conn, None, None
        self._roots.clear()
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Close the connection (and the REST client, when ``from_url`` built it)."""
        self.disconnect()
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> KVTransfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = self._path or f"not connected, {self.wanted}"
        return f"KVTransfer({self.client.base_url!r}, {where})"

    # -- by tokens ---------------------------------------------------------------------------

    def load_into(
        self, tokens: Tokens, out: Sequence[Any], *, session_id: str | None = None
    ) -> Transferred:
        """Load the longest cached prefix of ``tokens``' full blocks into ``out`` (one block-
        sized buffer per block, as many as the caller wants at most: numpy arrays, CPU or CUDA
        tensors, writable buffers); ``blocks`` says how many leading buffers were filled."""
        self._check_tokens()
        path, conn = self.path, self._conn
        start = time.perf_counter()
        if conn is None:
            n = ops.load_rest(
                self.client,
                tokens,
                ops.Targets.buffers(out),
                lease_ms=self.lease_ms,
                session_id=session_id,
            )
        else:
            root = self.root(self.client.namespace)
            ids = conn.block_hashes(root, tokens)[: len(out)]
            got = ops.load(
                conn,
                root,
                ids,
                ops.Targets.buffers(out[: len(ids)]),
                lease_ms=self.lease_ms,
                counted=True,
                session_id=session_id,
            )
            n = got.count(True)
        nbytes = sum(payload_nbytes(b) for b in out[:n]) if n else 0
        return Transferred(path, n, nbytes, time.perf_counter() - start)

    def store_from(
        self,
        tokens: Tokens,
        payloads: Sequence[Any],
        *,
        session_id: str | None = None,
        ttl_s: float | None = None,
        first_block: int = 0,
        durable: bool = False,
        finish_reason: str | None = None,
    ) -> Transferred:
        """Store one payload per full block of ``tokens`` from block ``first_block`` on
        (blocks before it are held already: their ids chain the new ones; the node derives
        every id and skips those it holds); ``blocks`` counts the blocks the node kept (stored
        or already held; a full tier drops the rest of a chain). ``durable``: answered once
        the blocks are on disk; else once the node's first tier holds them (write-behind).
        ``finish_reason`` (with ``session_id``): the request whose KV this is has finished,
        for this reason (``tool_use``, ``stop``, ...); with no payloads it is sent alone
        (``finish_session``)."""
        self._check_tokens()
        if finish_reason is not None and session_id is None:
            raise InvalidInput("a finish_reason is a session's: give the session_id too")
        path, conn = self.path, self._conn
        bt = self.client.namespace.block_tokens
        token_bytes = tokens_to_le_bytes(tokens)
        end = first_block + len(payloads)
        if first_block < 0 or end * bt * 4 > len(token_bytes):
            raise InvalidInput(
                f"blocks {first_block}..{end} of a prompt of {len(token_bytes) // 4 // bt} "
                "full blocks"
            )
        head = np.frombuffer(token_bytes, dtype="<u4")[: end * bt]
        start = time.perf_counter()
        kept = len(payloads)
        if conn is None:
            views = [as_buffer(p, writable=False) for p in payloads]

            def payload(i: int) -> memoryview:
                if i < first_block:
                    raise InvalidInput(f"block {i} is not held and its payload was not given")
                return views[i - first_block]

            result = self.client.store(
                head,
                payload,
                session_id=session_id,
                ttl_s=ttl_s,
                durable=durable,
                finish_reason=finish_reason,
            )
            kept = max(0, result.kept - first_block)
        elif not payloads:  # no STORE to carry the finish: said alone
            if finish_reason is not None and session_id is not None:
                ops.finish_session(self, session_id, finish_reason)
        else:
            ack = ops.store(
                conn,
                self.root(self.client.namespace),
                head,
                payloads,
                block_tokens=bt,
                first=first_block,
                ttl_s=ttl_s,
                session_id=session_id,
                durable=durable,
                finish_reason=finish_reason,
            )
            kept = ack.kept
        nbytes = sum(payload_nbytes(p) for p in payloads[:kept])
        return Transferred(path, kept, nbytes, time.perf_counter() - start)

    # -- by keys -----------------------------------------------------------------------------

    def root(self, namespace: Namespace) -> bytes:
        """The caller's root of ``namespace`` on this connection (RESOLVE once per namespace
        and connection; with an API key it carries the tenant's salt)."""
        return ops.resolve(self._dataplane("a namespace root"), self._roots, namespace)

    def key_ids(self, namespace: Namespace | bytes, keys: Sequence[bytes]) -> list[bytes]:
        """The ids of the keyed blocks of ``keys`` (16 bytes each) in ``namespace`` (or under a
        root resolved on this connection), computed here as the node does."""
        conn = self._dataplane("keyed ids")
        root = namespace if isinstance(namespace, bytes) else self.root(namespace)
        return conn.key_ids(root, keys)

    def exists_keyed(
        self, namespace: Namespace, keys: Sequence[bytes], *, counted: bool = True
    ) -> list[bool]:
        """For each key, whether the node holds its block (nothing touched nor leased).
        ``counted``: the prompt's question (its blocks count as hit or miss tokens); False for
        a probe."""
        conn = self._dataplane("exists_keyed")
        root = self.root(namespace)
        return conn.exists(root, conn.key_ids(root, keys), counted=counted)

    def held_prefix_keyed(
        self, namespace: Namespace, keys: Sequence[bytes], *, counted: bool = True
    ) -> int:
        """How many of ``keys``, from the first, the node holds: a keyed LOOKUP without a lease
        (unlike ``exists_keyed`` it also finds blocks in a fleet's shared tier)."""
        conn = self._dataplane("held_prefix_keyed")
        root = self.root(namespace)
        return ops.held(conn, root, conn.key_ids(root, keys), keyed=True, counted=counted)

    def load_keyed(
        self,
        namespace: Namespace,
        keys: Sequence[bytes],
        out: Sequence[Any],
        *,
        prefix: bool = False,
        counted: bool = False,
    ) -> list[bool]:
        """Read the block of each held key into its buffer of ``out`` (one exactly
        block-sized buffer per key; a miss leaves its buffer alone); which were read.
        ``prefix``: only the run held from the first key is wanted: everything past the first
        miss is reported unread and no request goes past the one that met it (on the stream,
        held blocks of that request past the miss may still have filled their buffers).
        ``counted``: the keys are the prompt's question (a counted EXISTS first); by default
        the load counts nothing, as a fetch of blocks the caller has asked about already."""
        if len(keys) != len(out):
            raise InvalidInput(f"{len(keys)} keys for {len(out)} buffers")
        conn = self._dataplane("load_keyed")
        root = self.root(namespace)
        ids = conn.key_ids(root, keys)
        if counted:
            conn.exists(root, ids, counted=True)
        targets = ops.Targets.buffers(out)
        return ops.load(conn, root, ids, targets, lease_ms=self.lease_ms, keyed=True, prefix=prefix)

    def store_keyed(
        self,
        namespace: Namespace,
        keys: Sequence[bytes],
        payloads: Sequence[Any],
        *,
        parent_key: bytes | None = None,
        linked: bool = True,
        ttl_s: float | None = None,
        held: Sequence[bool] | None = None,
    ) -> StoreAck:
        """Store one payload per 16-byte block key. ``linked`` records the batch as a chain
        (block ``i`` hangs off block ``i - 1``) for tail-first eviction; else each block stands
        alone. ``parent_key``: the key of the block the batch continues, when the node still
        holds it (an uncounted probe; evicted meanwhile, the batch starts a chain of its own).
        Payloads of several sizes go in one STORE per run of one size (the linked runs one
        chain); a namespace's blocks have one size, so a run of another size is refused.
        ``held``: per key, the node holds it already (``exists_keyed(counted=False)``): such
        blocks are answered ``present`` and their payloads neither read nor sent (None may
        stand for them); a linked run after one hangs off it."""
        conn = self._dataplane("store_keyed")
        root = self.root(namespace)
        if len(keys) != len(payloads):
            raise InvalidInput(f"{len(keys)} keys for {len(payloads)} payloads")
        if held is not None and len(held) != len(keys):
            raise InvalidInput(f"{len(held)} held flags for {len(keys)} keys")
        parent: bytes | None = None
        if parent_key is not None:
            (parent,) = conn.key_ids(root, [parent_key])
            if not conn.exists(root, [parent], counted=False)[0]:
                parent = None
        skip = list(held) if held is not None else [False] * len(keys)
        ids = conn.key_ids(root, keys) if any(skip) else []
        hashes: list[bytes] = []
        status: list[BlockStatus] = []
        durable = True
        sent = False
        sizes = [0 if s else payload_nbytes(p) for p, s in zip(payloads, skip, strict=True)]
        start = 0
        while start < len(payloads):
            if skip[start]:
                hashes.append(ids[start])
                status.append(BlockStatus.PRESENT)
                parent = ids[start] if linked else None
                start += 1
                continue
            end = start + 1
            while end < len(payloads) and not skip[end] and sizes[end] == sizes[start]:
                end += 1
            run = keys[start:end], payloads[start:end]
            try:
                ack = conn.store_keyed(root, *run, parent=parent, linked=linked, ttl_s=ttl_s)
            except StoreRefused:
                # a parent the caller found held but evicted since (refused before any block
                # is stored): the run stands alone
                if start == 0 or not skip[start - 1] or parent is None or conn.broken:
                    raise
                ack = conn.store_keyed(root, *run, parent=None, linked=linked, ttl_s=ttl_s)
            hashes += ack.hashes
            status += ack.status
            durable = durable and ack.durable
            sent = True
            parent = ack.hashes[-1] if linked and ack.held[-1] else None
            start = end
        return StoreAck(hashes, status, durable and sent)

    def unsent_keyed(self, namespace: Namespace, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether a ``store_keyed`` need not send its block, the node holding it
        already (an uncounted EXISTS over the stream; on the same host the STAGE answers held
        blocks present, and none is asked): its ``held``."""
        conn = self._dataplane("unsent_keyed")
        root = self.root(namespace)
        return ops.unsent_keyed(conn, root, conn.key_ids(root, keys))

    # -- paths ---------------------------------------------------------------------------

    def _connect(self) -> tuple[Path, StreamClient | None]:
        order = self.paths if self.wanted == "auto" else (cast(Path, self.wanted),)
        errors: list[str] = []
        for path in order:
            if path == "rest":
                return "rest", None
            try:
                return path, self._open(path)
            except (SessionCacheError, OSError) as exc:
                if self.wanted != "auto":
                    raise
                log.info("no %s path to %s (%s): trying the next", path, self.client.base_url, exc)
                errors.append(f"{path}: {exc}")
        raise TransportError(f"no data path to {self.client.base_url}: " + "; ".join(errors))

    def _open(self, path: Path) -> StreamClient:
        if path == "stream":
            return self.client.stream(timeout=self.timeout)
        return self.client.same_host(timeout=self.timeout)

    def _dataplane(self, what: str) -> StreamClient:
        """The data-plane connection (connecting on first use); keyed blocks need one."""
        path = self.path
        if self._conn is None:
            raise InvalidInput(
                f"{what}: keyed blocks travel over the same_host or stream path only, and this "
                f"transfer to {self.client.base_url} took the {path} path (the REST API has no "
                "keyed blocks; paths=DATA_PLANE_PATHS never falls back to it)"
            )
        return self._conn

    def _check_tokens(self) -> None:
        if not self._by_tokens:
            raise InvalidInput(
                "this transfer was built without a namespace: loads and stores by tokens need "
                "one (KVTransfer.from_url(..., namespace=...)); keyed operations name theirs"
            )
