"""SGLang's hierarchical cache (HiCache) stores its pages in sessioncache.

``SessionCacheHiCacheStorage`` is a ``sglang.srt.mem_cache.hicache_storage.HiCacheStorage``:
SGLang loads it with ``--hicache-storage-backend dynamic`` and
``--hicache-storage-backend-extra-config '{"backend_name": "sessioncache", "module_path":
"sessioncache.connector.sglang", "class_name": "SessionCacheHiCacheStorage", "url": ...}'``
(docs/sglang.md). Importing this module imports ``sglang``; nothing else in sessioncache does.

SGLang names a page by an opaque string (a hash of its tokens and of the pages before it), so
pages are *keyed blocks* (docs/dataplane.md): a block's id is derived from the namespace root
and ``hashing.block_key`` of the page's key alone. Pages move over the data plane, never
per-block HTTP: through the node's shared memory when it runs on this host, else over the
binary stream: each of SGLang's storage threads has its own ``KVTransfer``, whose keyed
operations pick the path (``path`` / the ``SESSIONCACHE_DATA_PATH`` variable force one) and
move the pages (``connector.ops``). SGLang's threads never see an exception from the node: a
failed call answers a miss or a write not made, and after a failure of the node calls do so at
once for a backoff (``retry.NodeBackoff``, from ``retry_after_s``), then reconnect.

Two page formats, one namespace each (they never mix):

* the zero-copy interface (``"interface_v1": true`` in the extra config, ``batch_get_v1`` /
  ``batch_set_v1``): each page is the host regions ``HostKVCache.get_page_buffer_meta`` gives
  (K and V of the page for SGLang's page-first layouts, one region for MLA), one block each,
  read and written in place in SGLang's host pool;
* the tensor interface (``get`` / ``set`` / ``batch_get`` / ``batch_set``): one block per page,
  the flat page tensor SGLang hands over.

A batch SGLang writes is one request's consecutive pages (``extra_info.prefix_keys`` are the
pages before it): its blocks are stored as a chain continuing from the last prefix page when
the node still holds it, so tail-first eviction drops a sequence's last pages first.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from sessioncache.connector.client import SessionCacheClient
from sessioncache.connector.retry import MAX_BACKOFF_S, NodeBackoff
from sessioncache.connector.transfer import (
    DATA_PLANE_PATHS,
    DEFAULT_LEASE_MS,
    KEYED_ONLY,
    PATH_ENV,
    KVTransfer,
    Path,
)
from sessioncache.errors import InvalidInput
from sessioncache.hashing import Namespace, block_key

logger = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8080"
URL_ENV = "SESSIONCACHE_URL"
API_KEY_ENV = "SESSIONCACHE_API_KEY"
PAGE_PATHS = DATA_PLANE_PATHS
"""The data paths pages take (the REST API has no keyed blocks)."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class HiCacheOptions:
    """What the extra config (``--hicache-storage-backend-extra-config``) says to us; the
    ``SESSIONCACHE_URL`` and ``SESSIONCACHE_API_KEY`` variables stand in for ``url`` and
    ``api_key``."""

    url: str = DEFAULT_URL
    api_key: str | None = None
    path: str = "auto"
    """``auto`` (same-host shared memory when the node is on this host, else the stream),
    ``same_host`` or ``stream``."""
    ttl_s: float | None = None
    """How long pages live unread (default: the node's ``SESSIONCACHE_DEFAULT_TTL_S``)."""
    salt: str | None = None
    """Isolates these pages from other engines' of the same model (beside the tenant's)."""
    seed: int = 0
    """The node's ``SESSIONCACHE_HASH_SEED``."""
    lease_ms: int = DEFAULT_LEASE_MS
    interface_v1: bool = False
    timeout_s: float = 30.0
    retry_after_s: float = 5.0
    """After a failure of the node, calls fail at once for this long (SGLang's storage
    threads are not held up by one timeout per call), twice as long after each failure in a
    row, up to ``retry.MAX_BACKOFF_S`` (``retry.NodeBackoff``)."""

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> HiCacheOptions:
        extra = dict(extra or {})
        path = str(extra.get("path") or os.environ.get(PATH_ENV) or "auto")
        if path != "auto" and path not in PAGE_PATHS:
            raise InvalidInput(f"path must be auto, same_host or stream, got {path!r}")
        ttl = extra.get("ttl_s")
        return cls(
            url=str(extra.get("url") or os.environ.get(URL_ENV) or DEFAULT_URL),
            api_key=extra.get("api_key") or os.environ.get(API_KEY_ENV) or None,
            path=path,
            ttl_s=float(ttl) if ttl is not None else None,
            salt=extra.get("salt"),
            seed=int(extra.get("seed", 0)),
            lease_ms=int(extra.get("lease_ms", DEFAULT_LEASE_MS)),
            interface_v1=bool(extra.get("interface_v1", False)),
            timeout_s=float(extra.get("timeout_s", 30.0)),
            retry_after_s=float(extra.get("retry_after_s", 5.0)),
        )


def shard_tag(config: HiCacheStorageConfig) -> str:
    """What tells apart the pages of two ranks of one model, as SGLang's file backend keys
    them: MLA KV is the same on every TP rank (one copy), other KV is split by TP rank; PP
    stages, attention context-parallel ranks and DCP shards always differ."""
    parts = []
    if not config.is_mla_model:
        parts.append(f"tp{config.tp_rank}of{config.tp_size}")
    if config.pp_size > 1:
        parts.append(f"pp{config.pp_rank}of{config.pp_size}")
    if config.attn_cp_size > 1:
        parts.append(f"cp{config.attn_cp_rank}of{config.attn_cp_size}")
    if config.dcp_size > 1:
        parts.append(
            f"tp{config.tp_size}dcp{config.dcp_rank}of{config.dcp_size}"
            f"page{config.logical_page_size}"
        )
    return ",".join(parts) or "single"


def host_view(ptr: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` of host memory at ``ptr`` (a region of SGLang's host
    pool, which outlives the call), without copying."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(ptr)).cast("B")


class SessionCacheHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang HiCache pages in a sessioncache node (the module docstring)."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        self.storage_config = storage_config
        self.options = HiCacheOptions.from_extra_config(storage_config.extra_config)
        self.mem_pool_host: Any = None
        self._client = SessionCacheClient(
            self.options.url,
            namespace=KEYED_ONLY,
            api_key=self.options.api_key,
            seed=self.options.seed,
            timeout=self.options.timeout_s,
        )
        self._namespace: Namespace | None = None
        self._regions: int | None = None
        self._local = threading.local()
        self._transfers: list[KVTransfer] = []
        self._lock = threading.Lock()
        self._closed = False
        self.backoff = NodeBackoff(
            base=self.options.retry_after_s, cap=max(MAX_BACKOFF_S, self.options.retry_after_s)
        )
        """The failure policy, shared by SGLang's storage threads."""

    # -- the namespace -----------------------------------------------------------------------

    def namespace(self) -> Namespace:
        """The namespace of this rank's pages: the model, the page geometry and format, and the
        shard. Fixed at first use (after SGLang registers its host pool)."""
        if self._namespace is None:
            config = self.storage_config
            pool = self.mem_pool_host
            page_size = int(getattr(pool, "page_size", 0) or config.logical_page_size or 1)
            dtype = str(getattr(pool, "dtype", "raw")).removeprefix("torch.")
            layout = str(getattr(pool, "layout", "flat"))
            interface = "v1" if self.options.interface_v1 else "pages"
            self._namespace = Namespace(
                model=config.model_name or "unnamed",
                block_tokens=page_size,
                kv_dtype=dtype,
                kv_layout=f"sglang-hicache:{interface}:{layout}:{shard_tag(config)}",
                salt=self.options.salt,
            )
        return self._namespace

    # -- connections -------------------------------------------------------------------------

    def _transfer(self) -> KVTransfer:
        """This thread's transfer, connected."""
        if self._closed:
            raise InvalidInput("the storage backend is closed")
        kv: KVTransfer | None = getattr(self._local, "kv", None)
        if kv is None:
            kv = KVTransfer(
                self._client,
                path=cast(Path, self.options.path),
                paths=PAGE_PATHS,
                lease_ms=self.options.lease_ms,
                timeout=self.options.timeout_s,
            )
            self._local.kv = kv
            with self._lock:
                self._transfers.append(kv)
        if not kv.connected:
            logger.info("sessioncache HiCache backend: %s path to %s", kv.path, self.options.url)
        return kv

    @property
    def path(self) -> str:
        """The data path this thread's pages take (connecting on first use)."""
        return self._transfer().path

    def _run(self, what: str, op: Callable[[KVTransfer], T], failed: T) -> T:
        """Run ``op`` on this thread's transfer under the engine side's failure policy
        (``retry.NodeBackoff``): SGLang's storage threads get ``failed``, never an exception;
        after a failure of the node, at once for the backoff; then the call reconnects."""
        return self.backoff.call(
            f"HiCache {what}", lambda: op(self._transfer()), failed, self._disconnect
        )

    def _disconnect(self) -> None:
        """Close this thread's connection (the next call after the backoff connects)."""
        kv: KVTransfer | None = getattr(self._local, "kv", None)
        if kv is not None:
            kv.disconnect()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            transfers, self._transfers = self._transfers, []
        for kv in transfers:
            kv.close()
        self._client.close()

    # -- blocks by key -----------------------------------------------------------------------

    def _held_prefix(self, kv: KVTransfer, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, the node holds: a keyed LOOKUP without a
        lease (unlike EXISTS it also finds blocks in a fleet's shared tier)."""
        return kv.held_prefix_keyed(self.namespace(), [block_key(k) for k in keys])

    def _load(self, kv: KVTransfer, keys: Sequence[str], out: Sequence[Any]) -> list[bool]:
        """Read the blocks of ``keys`` into ``out`` (one exactly block-sized buffer each);
        which were read: the held run of them from the first (SGLang only uses a prefix).
        Uncounted: SGLang asked (``batch_exists``) before."""
        block_keys = [block_key(k) for k in keys]
        return kv.load_keyed(self.namespace(), block_keys, out, prefix=True, counted=False)

    def _store(
        self,
        kv: KVTransfer,
        keys: Sequence[str],
        payloads: Sequence[Any],
        after: str | None = None,
    ) -> list[bool]:
        """Store one block per key as one chain, continuing from the block of ``after`` when
        the node still holds it; which blocks the node holds afterwards. Only the blocks the
        node lacks are sent: over the stream an uncounted EXISTS comes first (on the same host
        the STAGE answers held blocks present, and nothing is copied for them)."""
        if not keys:
            return []
        namespace = self.namespace()
        block_keys = [block_key(k) for k in keys]
        held = kv.unsent_keyed(namespace, block_keys)
        if all(held):
            return held
        ack = kv.store_keyed(
            namespace,
            block_keys,
            [None if h else p for p, h in zip(payloads, held, strict=True)],
            parent_key=block_key(after) if after is not None else None,
            linked=True,
            ttl_s=self.options.ttl_s,
            held=held,
        )
        return ack.held

    # -- the tensor interface ----------------------------------------------------------------

    def get(
        self,
        key: str,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> Any:
        """Read the page of ``key`` into ``target_location`` (a page-sized CPU tensor) and
        return it; None when the node does not hold it."""
        got = self.batch_get([key], [target_location])
        return got[0] if isinstance(got, list) else None

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[Any]:
        if target_locations is None or len(target_locations) != len(keys):
            raise InvalidInput("batch_get reads into SGLang's page buffers: one per key")
        found = self._run(
            "batch_get", lambda c: self._load(c, keys, target_locations), [False] * len(keys)
        )
        return [t if ok else None for t, ok in zip(target_locations, found, strict=True)]

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        if values is None or len(values) != len(keys):
            raise InvalidInput("batch_set stores one page tensor per key")
        kept = self._run("batch_set", lambda c: self._store(c, keys, values), [False])
        return all(kept)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many of ``keys``, from the first, the node holds (all of a page's blocks)."""
        m = self._regions_per_page() if self.options.interface_v1 else 1
        block_keys = [region_key(k, j, m) for k in keys for j in range(m)]
        return self._run("batch_exists", lambda c: self._held_prefix(c, block_keys), 0) // m

    # -- the zero-copy interface -------------------------------------------------------------

    def _regions_per_page(self) -> int:
        """How many host regions (blocks) make one page of the registered pool."""
        if self._regions is None:
            pool = self.mem_pool_host
            if pool is None:
                raise InvalidInput("the zero-copy interface needs SGLang's host pool registered")
            import torch

            ptrs, _ = pool.get_page_buffer_meta(torch.arange(pool.page_size, dtype=torch.int64))
            self._regions = max(1, len(ptrs))
        return self._regions

    def _page_views(self, keys: Sequence[str], host_indices: Any) -> tuple[list[str], list[Any]]:
        """The block keys and host-pool views of ``keys``' pages at ``host_indices``."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(ptrs) % len(keys):
            raise InvalidInput(f"{len(ptrs)} host regions for {len(keys)} pages")
        if len(set(sizes)) > 1:
            # a namespace holds blocks of one size; pools whose pages have regions of several
            # sizes (MLA's page_first_kv_split for DSA models) are not supported
            raise InvalidInput(
                f"host regions of several sizes ({sorted(set(sizes))}): use a page-first or "
                "layer-first host layout"
            )
        m = len(ptrs) // len(keys)
        block_keys = [region_key(k, j, m) for k in keys for j in range(m)]
        views = [host_view(int(p), int(s)) for p, s in zip(ptrs, sizes, strict=True)]
        return block_keys, views

    @staticmethod
    def _per_page(found: Sequence[bool], pages: int) -> list[bool]:
        m = len(found) // pages
        return [all(found[i * m : (i + 1) * m]) for i in range(pages)]

    def _pages_v1(
        self,
        what: str,
        keys: list[str],
        host_indices: Any,
        op: Callable[[KVTransfer, list[str], list[Any]], list[bool]],
    ) -> list[bool]:
        """``op`` on the blocks of ``keys``' pages at ``host_indices`` in SGLang's host pool
        (their block keys and views); per page, whether all of its blocks were done."""
        if not keys:
            return []

        def pages(kv: KVTransfer) -> list[bool]:
            block_keys, views = self._page_views(keys, host_indices)
            return self._per_page(op(kv, block_keys, views), len(keys))

        return self._run(what, pages, [False] * len(keys))

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: Any,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read ``keys``' pages straight into SGLang's host pool at ``host_indices``."""
        return self._pages_v1("batch_get_v1", keys, host_indices, self._load)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: Any,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store ``keys``' pages straight from SGLang's host pool at ``host_indices``; they
        continue the chain of ``extra_info.prefix_keys``."""
        prefix = extra_info.prefix_keys if extra_info is not None else None

        def store(kv: KVTransfer, block_keys: list[str], views: list[Any]) -> list[bool]:
            m = len(block_keys) // len(keys)
            after = region_key(prefix[-1], m - 1, m) if prefix else None
            return self._store(kv, block_keys, views, after)

        return self._pages_v1("batch_set_v1", keys, host_indices, store)

    def clear(self) -> None:
        """Nothing: pages leave the node by eviction and TTL, never by one engine's word."""

    def get_stats(self) -> None:
        return None


def region_key(key: str, region: int, regions: int) -> str:
    """The block key of region ``region`` of a page of ``regions`` regions (the page's own key
    when it is one region)."""
    return key if regions == 1 else f"{key}#{region}"


__all__ = ["HiCacheOptions", "SessionCacheHiCacheStorage", "host_view", "region_key", "shard_tag"]
