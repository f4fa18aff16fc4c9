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
memoryviews LMCache hands over, sets straight out of them), else over the block stream. Each
worker's ``KVTransfer`` (its keyed operations, ``paths=DATA_PLANE_PATHS``) picks the path and
runs the loops (``connector.ops``). A failure of the node makes the batches fail at once for a
backoff (``retry.NodeBackoff``), after which the next one connects again.

A set batch is stored as one chain (``linked``): LMCache sets one request's consecutive
chunks together, so tail-first eviction then drops a request's last chunks first. Only the
blocks the node lacks are sent: over the stream an uncounted EXISTS comes first; on the same
host the STAGE answers held blocks present, and nothing is copied for them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sessioncache.connector.payloads import as_buffer
from sessioncache.connector.retry import NodeBackoff, NodeDown
from sessioncache.connector.transfer import DATA_PLANE_PATHS, KVTransfer
from sessioncache.errors import InvalidInput
from sessioncache.hashing import Namespace, block_key
from sessioncache.status import BlockStatus

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


def _connect(settings: L2Settings) -> KVTransfer:
    """One worker's transfer, connected (same host first with ``auto``, else the stream)."""
    s = settings
    kv = KVTransfer.from_url(
        s.url,
        api_key=s.api_key,
        timeout=s.timeout_s,
        path=s.data_path,
        paths=DATA_PLANE_PATHS,
        lease_ms=s.lease_ms,
    )
    try:
        path = kv.path
    except BaseException:
        kv.close()
        raise
    log.info("sessioncache L2: %s path to %s", path, s.url)
    return kv


def _namespace(settings: L2Settings, model: str, salt: str | None) -> Namespace:
    s = settings
    return Namespace(model, s.block_tokens, s.kv_dtype, s.kv_layout, salt=salt)


_WHY = {
    BlockStatus.DROPPED: "dropped (the node has no room, or an earlier block of the chain left)",
    BlockStatus.REJECTED: "rejected (a shared-memory slot did not hold what was written)",
}


def _why(missed: Counter[BlockStatus]) -> str:
    """What the node answered for the blocks it did not take, by status."""
    return ", ".join(f"{n} {_WHY.get(status, status.value)}" for status, n in missed.items())


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
        connections: list[KVTransfer] = []
        try:
            for _ in range(workers):
                connections.append(_connect(self.settings))
        except BaseException:
            for conn in connections:
                conn.close()
            raise
        self.data_path = connections[0].path
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.Lock()
        self._done: list[Completion] = []
        self._next = 1
        self._jobs: queue.SimpleQueue[tuple[int, Callable[[KVTransfer], Outcome]] | None]
        self._jobs = queue.SimpleQueue()
        self._closed = False
        self.backoff = NodeBackoff()
        """The engine side's failure policy, shared by the workers: after a failure of the
        node, batches complete failed at once for the backoff, then reconnect."""
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

    def _submit(self, job: Callable[[KVTransfer], Outcome]) -> int:
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

    def _work(self, kv: KVTransfer) -> None:
        """Run batches on this worker's transfer under the engine side's failure policy
        (``retry.NodeBackoff``): a batch that fails completes failed; after a failure of the
        node its connection is closed, batches complete failed at once for the backoff, and
        the next one after it connects again."""
        try:
            while True:
                item = self._jobs.get()
                if item is None:
                    return
                future_id, job = item
                try:
                    outcome = self.backoff.guard(functools.partial(job, kv), kv.disconnect)
                except Exception as exc:
                    if not isinstance(exc, NodeDown):
                        log.warning("sessioncache L2: batch %d failed: %s", future_id, exc)
                    self._complete((future_id, False, f"{type(exc).__name__}: {exc}", None))
                else:
                    self._complete((future_id, *outcome))
        finally:
            kv.close()

    def _set(self, kv: KVTransfer, keys: list[str], memviews: list[Any]) -> Outcome:
        s = self.settings
        missed: Counter[BlockStatus] = Counter()
        for (model, salt), items in _groups(keys).items():
            ns = _namespace(s, model, salt)
            block_keys = [k for _, k in items]
            held = kv.unsent_keyed(ns, block_keys)
            if all(held):
                continue
            # one STORE per payload size (KVTransfer.store_keyed): the node takes one per store
            ack = kv.store_keyed(
                ns,
                block_keys,
                [None if h else memviews[i] for (i, _), h in zip(items, held, strict=True)],
                linked=s.linked,
                ttl_s=s.ttl_s,
                held=held,
            )
            missed.update(s for s in ack.status if not s.held)
        if missed:
            return False, f"{missed.total()} of {len(keys)} blocks not stored: {_why(missed)}", None
        return True, "", None

    def _exists(self, kv: KVTransfer, keys: list[str]) -> Outcome:
        out = [False] * len(keys)
        for (model, salt), items in _groups(keys).items():
            ns = _namespace(self.settings, model, salt)
            held = kv.exists_keyed(ns, [k for _, k in items])
            for (i, _), ok in zip(items, held, strict=True):
                out[i] = ok
        return True, "", out

    def _get(self, kv: KVTransfer, keys: list[str], memviews: list[Any]) -> Outcome:
        """Each held block straight into its view (from shared memory on the same host). Not
        counted: LMCache asked its question (EXISTS) before this fetch."""
        out = [False] * len(keys)
        for (model, salt), items in _groups(keys).items():
            ns = _namespace(self.settings, model, salt)
            views = [as_buffer(memviews[i], writable=True) for i, _ in items]
            got = kv.load_keyed(ns, [k for _, k in items], views, counted=False)
            for (i, _), ok in zip(items, got, strict=True):
                out[i] = ok
        return True, "", out
