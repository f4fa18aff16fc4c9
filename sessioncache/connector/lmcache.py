"""LMCache's multiprocess mode on sessioncache: ``SessionCacheL2``, an L2 adapter for
``lmcache server`` (``docs/lmcache.md`` has the configuration to copy).

LMCache loads it with its generic ``native_plugin`` L2 adapter type::

    lmcache server ... --l2-adapter '{"type": "native_plugin",
        "module_path": "sessioncache.connector.lmcache", "class_name": "SessionCacheL2",
        "adapter_params": {"url": "http://127.0.0.1:8080", "api_key": "..."}}'

and drives it through the duck-typed interface of LMCache's ``NativeConnectorL2Adapter``:
``submit_batch_set / get / exists`` return a future id at once, the work runs on this
adapter's threads, and ``drain_completions`` hands back ``(future_id, ok, error, bools)`` once
``event_fd`` (an eventfd) has been signalled. Nothing here imports LMCache.

Keys arrive as ``model@kvrank08x@group_hex@chunkhash_hex[@salt]`` (LMCache's
``_object_key_to_string``). They map onto sessioncache as:

- ``model`` and the ``@salt`` (LMCache's ``cache_salt``, its per-user isolation) make the
  namespace: ``Namespace(model, block_tokens, kv_dtype, kv_layout, salt=salt)``, the other
  three fields from ``adapter_params``; the node adds the tenant of the API key on top;
- ``kvrank@group@chunkhash`` makes the 16-byte block key (``hashing.block_key``), so that a
  block is found by its key alone (keyed blocks, ``docs/dataplane.md``). The KV rank goes into
  the key, not the namespace: LMCache's own L2 benchmark gives every key its own rank, and
  one namespace per rank would cost the node a catalog write per key.

Payloads move over the data plane only, never per-block HTTP: through shared memory when the
node runs on this host and the tenant is trusted with it (gets copy straight into the
memoryviews LMCache hands over, sets straight out of them), else over the block stream.
A set batch is stored as one chain (``linked``): LMCache sets one request's consecutive
chunks together, so tail-first eviction then drops a request's last chunks first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sessioncache.connector.samehost import SameHostClient, SameHostLookup
from sessioncache.connector.stream import StreamClient, as_buffer
from sessioncache.errors import InvalidInput, SessionCacheError
from sessioncache.hashing import Namespace, block_key

log = logging.getLogger("sessioncache.connector.lmcache")

Completion = tuple[int, bool, str, list[bool] | None]
"""``(future_id, ok, error, per-key results or None)``, as LMCache's native clients answer."""
Outcome = tuple[bool, str, list[bool] | None]
"""A batch's ``(ok, error, per-key results or None)``."""
DataPath = Literal["auto", "same_host", "stream"]
KEY_SEP = "@"


class ParsedKey:
    """One LMCache key: the namespace it belongs to and its 16-byte block key."""

    __slots__ = ("block_key", "model", "salt")

    def __init__(self, text: str) -> None:
        parts = text.split(KEY_SEP)
        if len(parts) not in (4, 5) or not all(parts[:4]):
            raise InvalidInput(
                f"not an LMCache key (model@kvrank@group@chunkhash[@salt]): {text!r:.120}"
            )
        self.model = parts[0]
        self.salt = parts[4] if len(parts) == 5 and parts[4] else None
        self.block_key = block_key(KEY_SEP.join(parts[1:4]))


def parse_key(text: str) -> ParsedKey:
    return ParsedKey(text)


@dataclass(frozen=True, slots=True)
class L2Settings:
    """``adapter_params`` (keyword arguments of ``SessionCacheL2``)."""

    url: str
    api_key: str | None = None
    data_path: DataPath = "auto"
    block_tokens: int = 256
    """LMCache's chunk size in tokens (part of the namespace: KV of other chunkings differs)."""
    kv_dtype: str = "lmcache"
    kv_layout: str = "lmcache-mp"
    """Name the KV format; one payload size per namespace, so give each size its own."""
    workers: int = 2
    """Threads (each with its own connection) running batches in parallel."""
    linked: bool = True
    ttl_s: float | None = None
    lease_ms: int = 30_000
    timeout_s: float = 30.0


class _Connection:
    """One worker's connection and the roots it resolved."""

    def __init__(self, settings: L2Settings) -> None:
        self.settings = settings
        self.client = self._connect()
        self.roots: dict[tuple[str, str | None], bytes] = {}

    def _connect(self) -> StreamClient:
        s = self.settings
        if s.data_path in ("auto", "same_host"):
            try:
                return SameHostClient.discover(s.url, api_key=s.api_key, timeout=s.timeout_s)
            except (SessionCacheError, OSError) as exc:
                if s.data_path == "same_host":
                    raise
                log.info("sessioncache L2: no same-host path (%s); using the stream", exc)
        return StreamClient.discover(s.url, api_key=s.api_key, timeout=s.timeout_s)

    @property
    def same_host(self) -> bool:
        return isinstance(self.client, SameHostClient)

    def root(self, model: str, salt: str | None) -> bytes:
        root = self.roots.get((model, salt))
        if root is None:
            s = self.settings
            ns = Namespace(model, s.block_tokens, s.kv_dtype, s.kv_layout, salt=salt)
            root = self.client.resolve(ns)
            self.roots[(model, salt)] = root
        return root

    def close(self) -> None:
        self.client.close()


def _groups(keys: Sequence[str]) -> dict[tuple[str, str | None], list[tuple[int, bytes]]]:
    """The batch's keys by namespace, in order: ``(model, salt) -> [(index, block key)]``."""
    groups: dict[tuple[str, str | None], list[tuple[int, bytes]]] = {}
    for i, text in enumerate(keys):
        key = parse_key(text)
        groups.setdefault((key.model, key.salt), []).append((i, key.block_key))
    return groups


class SessionCacheL2:
    """LMCache's native L2 client interface over a sessioncache node (module docstring)."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        data_path: DataPath = "auto",
        block_tokens: int = 256,
        kv_dtype: str = "lmcache",
        kv_layout: str = "lmcache-mp",
        workers: int = 2,
        linked: bool = True,
        ttl_s: float | None = None,
        lease_ms: int = 30_000,
        timeout_s: float = 30.0,
    ) -> None:
        if data_path not in ("auto", "same_host", "stream"):
            raise InvalidInput(f"data_path is auto, same_host or stream, not {data_path!r}")
        if workers < 1:
            raise InvalidInput("workers must be at least 1")
        self.settings = L2Settings(
            url,
            api_key,
            data_path,
            block_tokens,
            kv_dtype,
            kv_layout,
            workers,
            linked,
            ttl_s,
            lease_ms,
            timeout_s,
        )
        # Connect every worker now: a wrong URL or key fails at start and shows in LMCache's
        # log, and no batch pays for a connection.
        connections: list[_Connection] = []
        try:
            for _ in range(workers):
                connections.append(_Connection(self.settings))
        except BaseException:
            for conn in connections:
                conn.close()
            raise
        self.data_path = "same_host" if connections[0].same_host else "stream"
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.Lock()
        self._done: list[Completion] = []
        self._next = 1
        self._jobs: queue.SimpleQueue[tuple[int, Callable[[_Connection], Outcome]] | None]
        self._jobs = queue.SimpleQueue()
        self._closed = False
        self._threads = [
            threading.Thread(
                target=self._work,
                args=(connections[i],),
                name=f"sessioncache-l2-{i}",
                daemon=True,
            )
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    # -- LMCache's interface -----------------------------------------------------------------

    def event_fd(self) -> int:
        return self._efd

    def submit_batch_set(self, keys: list[str], memviews: list[Any]) -> int:
        if len(keys) != len(memviews):
            raise InvalidInput(f"{len(keys)} keys for {len(memviews)} buffers")
        return self._submit(lambda conn: self._set(conn, keys, memviews))

    def submit_batch_get(self, keys: list[str], memviews: list[Any]) -> int:
        if len(keys) != len(memviews):
            raise InvalidInput(f"{len(keys)} keys for {len(memviews)} buffers")
        return self._submit(lambda conn: self._get(conn, keys, memviews))

    def submit_batch_exists(self, keys: list[str]) -> int:
        return self._submit(lambda conn: self._exists(conn, keys))

    def drain_completions(self) -> list[Completion]:
        with contextlib.suppress(BlockingIOError):  # reset the eventfd (nothing new: fine)
            os.eventfd_read(self._efd)
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join(10)
        os.close(self._efd)

    # -- the work ------------------------------------------------------------------------------

    def _submit(self, job: Callable[[_Connection], Outcome]) -> int:
        if self._closed:
            raise InvalidInput("the sessioncache L2 adapter is closed")
        with self._lock:
            future_id = self._next
            self._next += 1
        self._jobs.put((future_id, job))
        return future_id

    def _complete(self, completion: Completion) -> None:
        with self._lock:
            self._done.append(completion)
        os.eventfd_write(self._efd, 1)

    def _work(self, conn: _Connection | None) -> None:
        try:
            while True:
                item = self._jobs.get()
                if item is None:
                    return
                future_id, job = item
                try:
                    if conn is None:
                        conn = _Connection(self.settings)
                    ok, error, result = job(conn)
                    self._complete((future_id, ok, error, result))
                except Exception as exc:
                    log.warning("sessioncache L2: batch %d failed: %s", future_id, exc)
                    self._complete((future_id, False, f"{type(exc).__name__}: {exc}", None))
                    if conn is not None and conn.client.broken:
                        conn.close()
                        conn = None  # reconnect for the next batch
        finally:
            if conn is not None:
                conn.close()

    def _set(self, conn: _Connection, keys: list[str], memviews: list[Any]) -> Outcome:
        s = self.settings
        dropped = 0
        for (model, salt), items in _groups(keys).items():
            root = conn.root(model, salt)
            views = [as_buffer(memviews[i], writable=False) for i, _ in items]
            block_keys = [k for _, k in items]
            # one STORE per payload size (the node takes one size per store)
            start = 0
            while start < len(views):
                end = start + 1
                while end < len(views) and views[end].nbytes == views[start].nbytes:
                    end += 1
                ack = conn.client.store_keyed(
                    root, block_keys[start:end], views[start:end], linked=s.linked, ttl_s=s.ttl_s
                )
                dropped += len(ack.status) - sum(ack.held)
                start = end
        if dropped:
            return False, f"{dropped} of {len(keys)} blocks dropped: the node has no room", None
        return True, "", None

    def _exists(self, conn: _Connection, keys: list[str]) -> Outcome:
        out = [False] * len(keys)
        for (model, salt), items in _groups(keys).items():
            root = conn.root(model, salt)
            ids = conn.client.key_ids(root, [k for _, k in items])
            for (i, _), held in zip(items, conn.client.exists(root, ids), strict=True):
                out[i] = held
        return True, "", out

    def _get(self, conn: _Connection, keys: list[str], memviews: list[Any]) -> Outcome:
        out = [False] * len(keys)
        for (model, salt), items in _groups(keys).items():
            root = conn.root(model, salt)
            ids = conn.client.key_ids(root, [k for _, k in items])
            views = [as_buffer(memviews[i], writable=True) for i, _ in items]
            if isinstance(conn.client, SameHostClient):
                got = self._get_same_host(conn.client, root, ids, views)
            else:
                got = conn.client.load_into(ids, views, each=True)
            for (i, _), ok in zip(items, got, strict=True):
                out[i] = ok
        return True, "", out

    def _get_same_host(
        self, client: SameHostClient, root: bytes, ids: list[bytes], views: list[memoryview]
    ) -> list[bool]:
        """Copy each held block from shared memory straight into its view. A LOCATE answers
        the held run from the first id asked: after a miss, locate again past it. Not counted:
        LMCache asked its question (EXISTS) before this fetch."""
        got = [False] * len(ids)
        pos = 0
        while pos < len(ids):
            found: SameHostLookup = client.locate(
                root, ids[pos:], lease_ms=self.settings.lease_ms, keyed=True, counted=False
            )
            n = found.located
            if n:
                client.load_into(found, views[pos : pos + n])
                got[pos : pos + n] = [True] * n
            elif found.lease is not None:
                client.release_checked(found)
            if found.matched > n:
                # held, but not placeable in shared memory now: over the socket instead
                rest = client.load_into(ids[pos + n :], views[pos + n :], each=True)
                got[pos + n :] = rest
                break
            pos += n + 1  # ids[pos + n] is not held (or the run ended)
        return got
