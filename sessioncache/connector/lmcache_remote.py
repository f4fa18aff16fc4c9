"""LMCache's in-process mode (``LMCacheConnectorV1`` inside vLLM) on sessioncache: a remote
storage plugin, selected by LMCache's own configuration (``docs/lmcache.md``)::

    remote_storage_plugins: ["sessioncache"]
    extra_config:
      remote_storage_plugin.sessioncache.module_path: sessioncache.connector.lmcache_remote
      remote_storage_plugin.sessioncache.class_name: SessionCacheConnectorAdapter
      remote_storage_plugin.sessioncache.url: http://127.0.0.1:8080
      remote_storage_plugin.sessioncache.api_key: ...        # optional
      remote_storage_plugin.sessioncache.data_path: auto     # auto | same_host | stream

``class_name`` names the adapter, not the connector: LMCache hands an adapter the engine's
metadata (shapes, dtypes, chunk size), and builds a connector named directly without it.

Each LMCache chunk is one keyed block (``docs/dataplane.md``, "Keyed blocks"): its key is
``CacheEngineKey.to_string()`` (model, world size, worker, chunk hash, dtype, tags), its
payload LMCache's ``RemoteMetadata`` (length, shapes, dtypes, memory format: what a fresh
engine needs to allocate the chunk) followed by the chunk's bytes, zero-padded to one full
chunk, so that every block of a namespace has the one size the node requires. The namespace
is the model, the chunk size, the KV dtype and the padded size. Batched puts (one request's
consecutive chunks) are stored as one chain, so tail-first eviction applies; single puts
stand alone. Chunks the node holds already are neither packed nor sent (an uncounted EXISTS
first). The connector's ``KVTransfer`` (keyed operations, never the REST path) picks the
data path and moves the blocks: gets through shared memory on the node's host. A failure of
the node reaches LMCache; for a backoff after it (``retry.NodeBackoff``) gets and lookups
miss and puts are dropped at once, and the next call after it connects again.

This module imports LMCache (it subclasses its classes) and is imported only by LMCache.
The node's I/O is blocking: it runs on a thread of this connector, off LMCache's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector import (
    ConnectorAdapter,
    ConnectorContext,
    extract_plugin_type,
)
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from sessioncache.connector.payloads import as_buffer
from sessioncache.connector.retry import NodeBackoff, NodeDown
from sessioncache.connector.transfer import DATA_PLANE_PATHS, KVTransfer, Path
from sessioncache.errors import InvalidInput
from sessioncache.hashing import Namespace, block_key

log = logging.getLogger("sessioncache.connector.lmcache_remote")

PLUGIN_TYPE = "sessioncache"
T = TypeVar("T")


def plugin_setting(config: Any, plugin: str, name: str, default: str | None = None) -> str | None:
    """``extra_config["remote_storage_plugin.<plugin>.<name>"]``."""
    extra = getattr(config, "extra_config", None) or {}
    value = extra.get(f"remote_storage_plugin.{plugin}.{name}", default)
    return None if value is None else str(value)


def connect(url: str, api_key: str | None, data_path: str, namespace: Namespace) -> KVTransfer:
    """A transfer over the same-host path when the node offers it to us (``auto``), else the
    stream (never REST: it has no keyed blocks), connected and ``namespace`` resolved."""
    if data_path not in ("auto", "same_host", "stream"):
        raise InvalidInput(f"data_path is auto, same_host or stream, not {data_path!r}")
    kv = KVTransfer.from_url(
        url,
        api_key=api_key,
        namespace=namespace,
        path=cast(Path, data_path),
        paths=DATA_PLANE_PATHS,
    )
    try:
        kv.root(namespace)
    except BaseException:
        kv.close()
        raise
    return kv


class SessionCacheRemoteConnector(RemoteConnector):  # type: ignore[misc]
    """LMCache's ``RemoteConnector`` over a sessioncache node (module docstring)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any,
        metadata: Any,
        plugin_name: str = PLUGIN_TYPE,
    ) -> None:
        super().__init__(config, metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        url = plugin_setting(config, plugin_name, "url")
        if not url:
            raise InvalidInput(
                f"extra_config remote_storage_plugin.{plugin_name}.url is required "
                "(the node's REST URL, e.g. http://127.0.0.1:8080)"
            )
        api_key = plugin_setting(config, plugin_name, "api_key")
        data_path = plugin_setting(config, plugin_name, "data_path", "auto") or "auto"
        self.meta_bytes: int = self.remote_metadata_bytes
        self.block_bytes: int = self.meta_bytes + self.full_chunk_size_bytes
        dtypes = "+".join(str(d).removeprefix("torch.") for d in self.meta_dtypes)
        self.namespace = Namespace(
            model=str(metadata.model_name),
            block_tokens=int(metadata.chunk_size),
            kv_dtype=dtypes,
            kv_layout=f"lmcache-remote/{self.meta_fmt.name}/{self.block_bytes}",
        )
        self.transfer = connect(url, api_key, data_path, self.namespace)
        # one thread: the client is one connection, and its I/O blocks
        self._io = ThreadPoolExecutor(1, thread_name_prefix="sessioncache-lmcache")
        self._lock = threading.Lock()
        self.backoff = NodeBackoff()
        """The failure policy (``_guarded``)."""
        log.info(
            "sessioncache remote plugin: %s over %s, blocks of %d bytes",
            url,
            "shared memory" if self.transfer.path == "same_host" else "the stream",
            self.block_bytes,
        )

    # -- helpers ---------------------------------------------------------------------------

    @staticmethod
    def _keys(keys: list[Any]) -> list[bytes]:
        return [block_key(k.to_string()) for k in keys]

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn)

    def _guarded(self, op: Callable[[], T], missed: T) -> T:
        """``op`` under the engine side's failure policy (``retry.NodeBackoff``): a failure
        reaches LMCache as before, and after one of the node's the connection is closed and
        calls answer ``missed`` at once for the backoff (then the next one reconnects)."""
        try:
            return self.backoff.guard(op, self._disconnect)
        except NodeDown:
            return missed

    def _disconnect(self) -> None:
        with self._lock:
            self.transfer.disconnect()

    def _pack(self, memory_obj: Any) -> bytearray:
        """RemoteMetadata, then the chunk's bytes, zero-padded to one full chunk."""
        data = as_buffer(memory_obj.byte_array, writable=False)
        n = data.nbytes
        if n > self.full_chunk_size_bytes:
            raise InvalidInput(
                f"a chunk of {n} bytes; full chunks are {self.full_chunk_size_bytes}"
            )
        buf = bytearray(self.block_bytes)
        meta = RemoteMetadata(
            n, memory_obj.get_shapes(), memory_obj.get_dtypes(), memory_obj.get_memory_format()
        )
        meta.serialize_into(buf)
        buf[self.meta_bytes : self.meta_bytes + n] = data
        return buf

    def _unpack(self, buf: bytearray) -> Any:
        """A memory object of the local CPU backend holding the block's chunk (None when
        LMCache has no room)."""
        meta = RemoteMetadata.deserialize(buf)
        memory_obj = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt)
        if memory_obj is None:
            log.debug("sessioncache remote plugin: no room in LMCache's CPU buffer")
            return None
        try:
            view = as_buffer(memory_obj.byte_array, writable=True)  # ctypes' "<B" as "B"
            view[: meta.length] = memoryview(buf)[self.meta_bytes : self.meta_bytes + meta.length]
        except BaseException:
            memory_obj.ref_count_down()
            raise
        return memory_obj

    def _put_sync(self, keys: list[Any], memory_objs: list[Any], linked: bool) -> None:
        """Store the chunks the node lacks (nothing while the node is down)."""
        self._guarded(lambda: self._put(keys, memory_objs, linked), None)

    def _put(self, keys: list[Any], memory_objs: list[Any], linked: bool) -> None:
        """Store the chunks the node lacks (an uncounted check first: held ones are neither
        packed nor sent)."""
        block_keys = self._keys(keys)
        with self._lock:
            held = self.transfer.exists_keyed(self.namespace, block_keys, counted=False)
        if all(held):
            return
        payloads = [None if h else self._pack(m) for m, h in zip(memory_objs, held, strict=True)]
        with self._lock:
            self.transfer.store_keyed(
                self.namespace, block_keys, payloads, linked=linked, held=held
            )

    def _get_sync(self, keys: list[Any]) -> list[Any]:
        bufs = [bytearray(self.block_bytes) for _ in keys]

        def load() -> list[bool]:
            with self._lock:
                return self.transfer.load_keyed(self.namespace, self._keys(keys), bufs)

        found = self._guarded(load, [False] * len(keys))
        return [self._unpack(b) if ok else None for b, ok in zip(bufs, found, strict=True)]

    def _exists_sync(self, keys: list[Any]) -> list[bool]:
        def ask() -> list[bool]:
            with self._lock:
                return self.transfer.exists_keyed(self.namespace, self._keys(keys))

        return self._guarded(ask, [False] * len(keys))

    @staticmethod
    def _prefix(held: list[bool]) -> int:
        return held.index(False) if False in held else len(held)

    # -- RemoteConnector ---------------------------------------------------------------------

    async def exists(self, key: Any) -> bool:
        return (await self._run(lambda: self._exists_sync([key])))[0]

    def exists_sync(self, key: Any) -> bool:
        return self._exists_sync([key])[0]

    async def get(self, key: Any) -> Any:
        return (await self._run(lambda: self._get_sync([key])))[0]

    async def put(self, key: Any, memory_obj: Any) -> None:
        await self._run(lambda: self._put_sync([key], [memory_obj], linked=False))

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[Any], memory_objs: list[Any]) -> None:
        await self._run(lambda: self._put_sync(keys, memory_objs, linked=True))

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[Any]) -> list[Any]:
        return await self._run(lambda: self._get_sync(keys))

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        return self._prefix(self._exists_sync(keys))

    async def batched_async_contains(
        self, lookup_id: str, keys: list[Any], pin: bool = False
    ) -> int:
        return self._prefix(await self._run(lambda: self._exists_sync(keys)))

    async def list(self) -> list[str]:
        return []  # the node indexes blocks by id; LMCache's keys are not kept

    async def close(self) -> None:
        # waiting for the I/O thread blocks: off LMCache's event loop
        await asyncio.get_running_loop().run_in_executor(None, self._close_sync)

    def _close_sync(self) -> None:
        self._io.shutdown(wait=True)
        self.transfer.close()

    def __repr__(self) -> str:
        return f"<SessionCacheRemoteConnector {self.transfer!r}>"


class SessionCacheConnectorAdapter(ConnectorAdapter):  # type: ignore[misc]
    """What ``remote_storage_plugin.<name>.class_name`` names: builds the connector with the
    engine's metadata, for ``plugin://sessioncache`` (any plugin instance of that type)."""

    def __init__(self) -> None:
        super().__init__("sessioncache://")

    def can_parse(self, url: str) -> bool:
        if url.startswith(self.schema):
            return True
        if url.startswith("plugin://"):
            return bool(extract_plugin_type(url[len("plugin://") :]) == PLUGIN_TYPE)
        return False

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        return SessionCacheRemoteConnector(
            context.loop,
            context.local_cpu_backend,
            context.config,
            context.metadata,
            context.plugin_name or PLUGIN_TYPE,
        )
