"""KV payloads between an engine and a node by the fastest path the two have.

Three paths, fastest first (docs/dataplane.md):

* ``same_host``: blocks copied straight out of (and into) the node's CPU tier in shared memory,
  through the Unix socket the node names in ``GET /v1/dataplane`` (``SameHostClient``); taken
  when that socket exists on this host and the caller's tenant is trusted with it;
* ``stream``: the binary block stream over TCP (``StreamClient``);
* ``rest``: the HTTP API (batch GET, two-phase store), which every node serves.

``KVTransfer(client)`` picks the first path that connects (``path="auto"``); the ``path``
argument or ``SESSIONCACHE_DATA_PATH`` forces one. A session named in a load or a store travels
with it on every path (its TTL, chain pins, head and token totals; no REST call on the side).
One ``KVTransfer`` holds one data-plane connection: use one per thread.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, cast

import numpy as np

from sessioncache.connector.client import SessionCacheClient
from sessioncache.connector.errors import TransportError
from sessioncache.connector.stream import StreamClient, as_buffer
from sessioncache.errors import InvalidInput, SessionCacheError
from sessioncache.hashing import Tokens, tokens_to_le_bytes

Path = Literal["same_host", "stream", "rest"]
PATHS: tuple[Path, ...] = ("same_host", "stream", "rest")
PATH_ENV = "SESSIONCACHE_DATA_PATH"
DEFAULT_LEASE_MS = 30_000


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
    ) -> None:
        wanted = path or os.environ.get(PATH_ENV) or "auto"
        if wanted != "auto" and wanted not in PATHS:
            raise InvalidInput(f"path must be auto or one of {PATHS}, got {wanted!r}")
        self.client = client
        self.wanted = wanted
        self.lease_ms = lease_ms
        self._conn: StreamClient | None = None
        self._path: Path | None = None

    @property
    def path(self) -> Path:
        """The path in use (connecting on first use)."""
        if self._path is None:
            self._path, self._conn = self._connect()
        return self._path

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn, self._path = None, None

    def __enter__(self) -> KVTransfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the two operations ------------------------------------------------------------------

    def load_into(
        self, tokens: Tokens, out: Sequence[Any], *, session_id: str | None = None
    ) -> Transferred:
        """Load the longest cached prefix of ``tokens``' full blocks into ``out`` (one block-
        sized buffer per block, as many as the caller wants at most: numpy arrays, CPU or CUDA
        tensors, writable buffers); ``blocks`` says how many leading buffers were filled."""
        path, conn = self.path, self._conn
        start = time.perf_counter()
        if conn is None:
            n = self._load_rest(tokens, out, session_id)
        else:
            n = self._load_dataplane(conn, path, tokens, out, session_id)
        nbytes = sum(as_buffer(b, writable=False).nbytes for b in out[:n]) if n else 0
        return Transferred(path, n, nbytes, time.perf_counter() - start)

    def store_from(
        self,
        tokens: Tokens,
        payloads: Sequence[Any],
        *,
        session_id: str | None = None,
        ttl_s: float | None = None,
        first_block: int = 0,
    ) -> Transferred:
        """Store one payload per full block of ``tokens`` from block ``first_block`` on
        (blocks before it are held already: their ids chain the new ones; the node derives
        every id and skips those it holds); ``blocks`` counts the blocks the node kept (stored
        or already held; a full tier drops the rest of a chain)."""
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

            result = self.client.store(head, payload, session_id=session_id, ttl_s=ttl_s)
            kept = max(0, result.kept - first_block)
        else:
            root = self._root(conn)
            parent = conn.block_hashes(root, head[: first_block * bt])[-1] if first_block else None
            ack = conn.store(
                root,
                head[first_block * bt :],
                payloads,
                parent=parent,
                ttl_s=ttl_s,
                session_id=session_id,
            )
            kept = ack.kept
        nbytes = sum(as_buffer(p, writable=False).nbytes for p in payloads[:kept])
        return Transferred(path, kept, nbytes, time.perf_counter() - start)

    # -- paths ---------------------------------------------------------------------------

    def _connect(self) -> tuple[Path, StreamClient | None]:
        order: tuple[Path, ...] = PATHS if self.wanted == "auto" else (cast(Path, self.wanted),)
        errors: list[str] = []
        for path in order:
            if path == "rest":
                return "rest", None
            try:
                return path, self._open(path)
            except (SessionCacheError, OSError) as exc:
                if self.wanted != "auto":
                    raise
                errors.append(f"{path}: {exc}")
        raise TransportError("no data path: " + "; ".join(errors))  # pragma: no cover

    def _open(self, path: Path) -> StreamClient:
        if path == "stream":
            return self.client.stream()
        return self.client.same_host()

    def _root(self, conn: StreamClient) -> bytes:
        return conn.resolve(self.client.namespace)

    def _load_dataplane(
        self,
        conn: StreamClient,
        path: Path,
        tokens: Tokens,
        out: Sequence[Any],
        session_id: str | None,
    ) -> int:
        root = self._root(conn)
        ids = conn.block_hashes(root, tokens)[: len(out)]
        if not ids:
            return 0
        if path == "same_host":
            from sessioncache.connector.samehost import SameHostClient

            assert isinstance(conn, SameHostClient)
            located = conn.locate(root, ids, lease_ms=self.lease_ms, session_id=session_id)
            n = len(located.slots)
            if n:
                conn.load_into(located, out[:n])
            elif located.lease is not None:
                conn.release_checked(located)
            return n
        found = conn.lookup(root, ids, lease_ms=self.lease_ms, session_id=session_id)
        if found.matched:
            conn.load_into(found, out[: found.matched], release=True)
        return found.matched

    def _load_rest(self, tokens: Tokens, out: Sequence[Any], session_id: str | None) -> int:
        found = self.client.lookup(tokens, session_id=session_id, lease_ms=self.lease_ms)
        hashes = found.hashes[: len(out)]
        try:
            payloads = self.client.load(hashes) if hashes else []
        finally:
            if found.lease is not None:
                self.client.release(found.lease.id)
        n = 0
        for payload, dst in zip(payloads, out, strict=False):
            if payload is None:
                break
            _copy_into(dst, payload)
            n += 1
        return n


def _copy_into(dst: Any, payload: bytes) -> None:
    """Copy ``payload`` into the caller's buffer (a CUDA tensor through ``copy_``)."""
    if hasattr(dst, "device") and getattr(dst.device, "type", "cpu") != "cpu":
        import torch

        src = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        dst.view(-1).view(torch.uint8).copy_(src)
        return
    view = as_buffer(dst, writable=True)
    if view.nbytes != len(payload):
        raise InvalidInput(f"a {len(payload)}-byte block for a {view.nbytes}-byte buffer")
    view[:] = payload
