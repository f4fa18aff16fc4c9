"""``SessionCacheClient`` (sync) and ``AsyncSessionCacheClient``: the REST API v1 for engines.

The two classes mirror each other method for method; all request building, response parsing
and id checking lives in ``sessioncache.connector.protocol``, so they differ only in ``await``.

Block ids are computed here with the same code as the server (``sessioncache.hashing``), and
every id the server returns is checked against the client's own: a mismatch (another hash
seed, another namespace, another tenant salt) raises ``IdMismatch`` instead of letting an
engine reuse KV that is not its own. With an API key, the server salts every namespace with
the caller's tenant; the client learns its tenant once from ``GET /v1/whoami`` (lazily, on the
first call that needs ids) and derives the same salt.

``lookup_by_id`` sends the ids instead of the tokens: the client asks the server once per
namespace for the root it hashes under (``resolve``, ``POST /v1/namespaces/resolve``, tenant
salt applied), computes the chain itself and gets the compact answer. The server then neither
re-hashes the prompt nor lists every matched block; the matched ids are the first
``matched_blocks`` of the client's own.

One client holds one pooled HTTP connection set (``httpx``), safe to share between threads
(sync) or tasks (async). Transient failures are retried by ``retry`` (see ``retry.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Self, TypeVar

import httpx

from sessioncache.connector import protocol
from sessioncache.connector.errors import TransportError
from sessioncache.connector.protocol import (
    LookupResult,
    PayloadSource,
    Prefetch,
    Reply,
    Request,
    Resolved,
    Session,
    StoreResult,
    WhoAmI,
)
from sessioncache.connector.retry import ExponentialWithJitterBackoff, Retry
from sessioncache.connector.samehost import SameHostClient
from sessioncache.connector.stream import StreamClient
from sessioncache.errors import InvalidInput, NoRoom
from sessioncache.hashing import BlockHash, Namespace, Tokens

__all__ = ["AsyncSessionCacheClient", "SessionCacheClient"]

DEFAULT_TIMEOUT_S = 30.0


def default_retry() -> Retry:
    """Three attempts, 50 ms then 100 ms (full jitter)."""
    return Retry(ExponentialWithJitterBackoff(base=0.05, cap=2.0), attempts=3)


_Http = TypeVar("_Http", httpx.Client, httpx.AsyncClient)
_Transport = TypeVar("_Transport", httpx.BaseTransport, httpx.AsyncBaseTransport)


class _ClientBase(Generic[_Http, _Transport]):
    """The constructor, state and checks common to both clients (no I/O); each client names
    its ``httpx`` client class in ``_http_class``."""

    _http_class: Callable[..., _Http]

    def __init__(
        self,
        base_url: str,
        *,
        namespace: Namespace,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT_S,
        retry: Retry | None = None,
        seed: int = 0,
        max_connections: int = 16,
        headers: Mapping[str, str] | None = None,
        transport: _Transport | None = None,
    ) -> None:
        if not isinstance(namespace, Namespace):
            raise InvalidInput("namespace must be a sessioncache.Namespace")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
            raise InvalidInput(f"seed must be an unsigned 64-bit integer, got {seed!r}")
        if max_connections < 1:
            raise InvalidInput("max_connections must be >= 1")
        self.base_url = base_url.rstrip("/")
        self.namespace = namespace
        self.seed = seed
        self.retry = retry if retry is not None else default_retry()
        self._api_key = api_key
        # Without a key there is no tenant salt (a server with auth on answers 401 anyway).
        self._effective: Namespace | None = namespace if api_key is None else None
        self._resolved: dict[Namespace, Resolved] = {}
        all_headers = {"user-agent": "sessioncache-connector/1", **(headers or {})}
        if api_key is not None:
            all_headers["authorization"] = f"Bearer {api_key}"
        self._http: _Http = self._http_class(
            base_url=self.base_url,
            timeout=timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
            headers=all_headers,
            transport=transport,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r}, model={self.namespace.model!r})"

    def _learn(self, who: WhoAmI) -> WhoAmI:
        self._effective = protocol.effective_namespace(self.namespace, who)
        return who

    def _prompt(self, effective: Namespace, tokens: Tokens) -> protocol.Prompt:
        return protocol.prompt(effective, tokens, self.seed)

    def _remember(self, resolved: Resolved) -> Resolved:
        self._resolved[resolved.namespace] = resolved
        return resolved


def _transport_error(request: Request, exc: Exception) -> TransportError:
    return TransportError(f"{request.method} {request.path}: {type(exc).__name__}: {exc}")


class SessionCacheClient(_ClientBase[httpx.Client, httpx.BaseTransport]):
    """A blocking client of one sessioncache service (see the module docstring).

    ``namespace`` is the engine's KV namespace (model, block size, KV dtype and layout, and
    optionally a salt and a LoRA); ``seed`` must equal the service's ``SESSIONCACHE_HASH_SEED``.
    """

    _http_class = httpx.Client

    # -- plumbing --------------------------------------------------------------------------

    def _send_once(self, request: Request) -> Reply:
        try:
            r = self._http.request(
                request.method,
                request.path,
                json=request.json,
                content=request.content,
                headers=request.headers,
            )
        except httpx.TransportError as exc:
            raise _transport_error(request, exc) from exc
        return protocol.check(Reply(r.status_code, r.headers, r.content))

    def _send(self, request: Request) -> Reply:
        return self.retry.call(lambda: self._send_once(request))

    def _effective_namespace(self) -> Namespace:
        if self._effective is None:
            self.whoami()
        assert self._effective is not None
        return self._effective

    def close(self) -> None:
        """Close the pooled connections."""
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- ids -------------------------------------------------------------------------------

    def whoami(self) -> WhoAmI:
        """The caller's tenant and whether the server has auth on (remembered for the salt)."""
        return self._learn(protocol.parse_whoami(self._send(protocol.whoami_request())))

    def block_hashes(self, tokens: Tokens) -> list[BlockHash]:
        """The ids the service gives the full blocks of ``tokens`` for this client."""
        return self._prompt(self._effective_namespace(), tokens).hashes

    def resolve(self, namespace: Namespace | None = None) -> Resolved:
        """The root the server hashes ``namespace`` (default: the client's) under for this
        client, asked once per namespace and then remembered. ``IdMismatch`` when the server's
        hash seed is not the client's."""
        namespace = self.namespace if namespace is None else namespace
        known = self._resolved.get(namespace)
        if known is not None:
            return known
        reply = self._send(protocol.resolve_request(namespace))
        return self._remember(protocol.parse_resolve(reply, namespace, self.seed))

    # -- data path -------------------------------------------------------------------------

    def lookup(
        self,
        tokens: Tokens,
        *,
        session_id: str | None = None,
        lease_ms: int | None = None,
        explain: bool = False,
        declined: bool = False,
    ) -> LookupResult:
        """The longest cached prefix of ``tokens``' full blocks; with ``lease_ms`` the matched
        blocks are pinned that long (release early with ``release``); with ``explain``,
        ``LookupResult.miss`` says why the rest missed; ``declined``: the caller will load
        nothing, and the node counts the tokens it holds as missed for that reason."""
        p = self._prompt(self._effective_namespace(), tokens)
        request = protocol.lookup_request(
            self.namespace,
            p,
            session_id=session_id,
            lease_ms=lease_ms,
            explain=explain,
            declined=declined,
        )
        return protocol.parse_lookup(self._send(request), p)

    def lookup_by_id(
        self,
        tokens: Tokens,
        *,
        session_id: str | None = None,
        lease_ms: int | None = None,
        explain: bool = False,
        declined: bool = False,
    ) -> LookupResult:
        """``lookup``, sending the ids computed here from the resolved root instead of the
        tokens, with the compact answer: the same result for less work on the server."""
        p = protocol.id_prompt(self.resolve(), tokens)
        request = protocol.lookup_ids_request(
            self.namespace,
            p,
            session_id=session_id,
            lease_ms=lease_ms,
            explain=explain,
            declined=declined,
        )
        return protocol.parse_compact_lookup(self._send(request), p)

    def load(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        """The payloads of ``hashes`` in order (None for a block not held), in batches."""
        out: list[bytes | None] = []
        for chunk in protocol.batch_chunks(hashes):
            out += protocol.parse_batch(self._send(protocol.batch_request(chunk)), chunk)
        return out

    def store(
        self,
        tokens: Tokens,
        payloads: PayloadSource,
        *,
        session_id: str | None = None,
        ttl_s: float | None = None,
        durable: bool = False,
        finish_reason: str | None = None,
    ) -> StoreResult:
        """Store the KV of ``tokens``' full blocks: plan with ``POST /v1/store``, then upload
        each block the server lacks. ``payloads`` is a function of the block index or a
        sequence with one payload per full block; only the missing blocks' are read.
        ``durable``: each upload is answered once its block is on disk. ``finish_reason``
        (with ``session_id``): the request whose KV this is has finished, for this reason
        (``tool_use``, ``stop``, ...; see ``finish_session``)."""
        p = self._prompt(self._effective_namespace(), tokens)
        request = protocol.store_request(
            self.namespace, p, session_id=session_id, ttl_s=ttl_s, finish_reason=finish_reason
        )
        plan = protocol.parse_store(self._send(request), p)
        loop = protocol.upload_loop(plan)
        while (chunk := loop.next()) is not None:
            h = plan.missing[chunk.start]
            payload = protocol.payload_for(payloads, plan.index[h])
            try:
                up = protocol.parse_upload(
                    self._send(protocol.upload_request(h, payload, durable=durable))
                )
            except NoRoom:
                up = protocol.DROPPED_UPLOAD
            loop.done([h], [up.status], up.durable)
        return protocol.store_result(plan, loop)

    def release(self, lease_id: str) -> None:
        """Release a lookup's lease before it expires."""
        self._send(protocol.release_request(lease_id))

    def stream(self, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> StreamClient:
        """A ``StreamClient`` connected to this node's block stream (docs/dataplane.md), found
        with ``GET /v1/dataplane``, with this client's API key and seed: the fast path for
        payloads (one connection; use one per thread)."""
        address = protocol.parse_dataplane(self._send(protocol.dataplane_request()), self.base_url)
        if address is None:
            raise TransportError(f"{self.base_url} serves no block stream")
        return StreamClient.connect(address, api_key=self._api_key, seed=self.seed, timeout=timeout)

    def same_host(self, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> SameHostClient:
        """A ``SameHostClient`` on this node's same-host socket (shared memory; trusted tenants
        only, docs/dataplane.md), found with ``GET /v1/dataplane``; ``TransportError`` when
        the node serves none or runs on another host."""
        path = protocol.parse_same_host(self._send(protocol.dataplane_request()))
        if path is None or not os.path.exists(path.removeprefix("unix:")):
            raise TransportError(f"{self.base_url} serves no same-host socket on this host")
        return SameHostClient.connect(path, api_key=self._api_key, seed=self.seed, timeout=timeout)

    # -- sessions --------------------------------------------------------------------------

    def open_session(
        self,
        session_id: str | None = None,
        *,
        kind: str = "agent",
        ttl_s: float | None = None,
        parent: str | None = None,
    ) -> Session:
        """Open a session (or get the caller's open session with that id). ``parent``: the
        caller's session it was forked from (a subagent's): its close spares their prefix."""
        return protocol.parse_session(
            self._send(protocol.open_session_request(session_id, kind, ttl_s, parent))
        )

    def get_session(self, session_id: str) -> Session:
        return protocol.parse_session(self._send(protocol.get_session_request(session_id)))

    def extend_session(self, session_id: str, *, ttl_s: float | None = None) -> Session:
        """Slide the session's expiry (optionally with a new TTL)."""
        return protocol.parse_session(
            self._send(protocol.extend_session_request(session_id, ttl_s))
        )

    def finish_session(self, session_id: str, finish_reason: str) -> Session:
        """The session's latest request finished, for ``finish_reason`` (``tool_use``: the
        agent comes back in seconds; ``stop``, ``end_turn``: minutes or days; ``length``,
        ``abort``): its blocks are kept or evicted by when it is predicted back."""
        return protocol.parse_session(
            self._send(protocol.finish_session_request(session_id, finish_reason))
        )

    def hint_session(
        self, session_id: str, hint: Mapping[str, Any], *, block_tokens: int | None = None
    ) -> Session:
        """An agent hint for the session, in any of the field's formats (``agent_hint``,
        ``agent_hints``, ``retention_directives``: docs/sessions.md, "Agent hints")."""
        return protocol.parse_session(
            self._send(protocol.hint_session_request(session_id, hint, block_tokens))
        )

    def prefetch_session(self, session_id: str) -> Prefetch:
        """Start moving the session's chain into the node's CPU tier ahead of its next
        request (``accepted``, ``deferred`` or ``rejected``, and why)."""
        return protocol.parse_prefetch(self._send(protocol.prefetch_session_request(session_id)))

    def close_session(self, session_id: str) -> None:
        """Close the session: its pins go, its blocks age out by TTL."""
        self._send(protocol.close_session_request(session_id))

    def list_sessions(self) -> list[Session]:
        return protocol.parse_sessions(self._send(protocol.list_sessions_request()))


class AsyncSessionCacheClient(_ClientBase[httpx.AsyncClient, httpx.AsyncBaseTransport]):
    """The ``asyncio`` mirror of ``SessionCacheClient``: the same methods, awaited."""

    _http_class = httpx.AsyncClient

    # -- plumbing --------------------------------------------------------------------------

    async def _send_once(self, request: Request) -> Reply:
        try:
            r = await self._http.request(
                request.method,
                request.path,
                json=request.json,
                content=request.content,
                headers=request.headers,
            )
        except httpx.TransportError as exc:
            raise _transport_error(request, exc) from exc
        return protocol.check(Reply(r.status_code, r.headers, r.content))

    async def _send(self, request: Request) -> Reply:
        return await self.retry.acall(lambda: self._send_once(request))

    async def _effective_namespace(self) -> Namespace:
        if self._effective is None:
            await self.whoami()
        assert self._effective is not None
        return self._effective

    async def close(self) -> None:
        """Close the pooled connections."""
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- ids -------------------------------------------------------------------------------

    async def whoami(self) -> WhoAmI:
        """The caller's tenant and whether the server has auth on (remembered for the salt)."""
        return self._learn(protocol.parse_whoami(await self._send(protocol.whoami_request())))

    async def block_hashes(self, tokens: Tokens) -> list[BlockHash]:
        """The ids the service gives the full blocks of ``tokens`` for this client."""
        return self._prompt(await self._effective_namespace(), tokens).hashes

    async def resolve(self, namespace: Namespace | None = None) -> Resolved:
        """The root the server hashes ``namespace`` (default: the client's) under for this
        client, asked once per namespace and then remembered. ``IdMismatch`` when the server's
        hash seed is not the client's."""
        namespace = self.namespace if namespace is None else namespace
        known = self._resolved.get(namespace)
        if known is not None:
            return known
        reply = await self._send(protocol.resolve_request(namespace))
        return self._remember(protocol.parse_resolve(reply, namespace, self.seed))

    # -- data path -------------------------------------------------------------------------

    async def lookup(
        self,
        tokens: Tokens,
        *,
        session_id: str | None = None,
        lease_ms: int | None = None,
        explain: bool = False,
        declined: bool = False,
    ) -> LookupResult:
        """The longest cached prefix of ``tokens``' full blocks; with ``lease_ms`` the matched
        blocks are pinned that long (release early with ``release``); with ``explain``,
        ``LookupResult.miss`` says why the rest missed; ``declined``: the caller will load
        nothing, and the node counts the tokens it holds as missed for that reason."""
        p = self._prompt(await self._effective_namespace(), tokens)
        request = protocol.lookup_request(
            self.namespace,
            p,
            session_id=session_id,
            lease_ms=lease_ms,
            explain=explain,
            declined=declined,
        )
        return protocol.parse_lookup(await self._send(request), p)

    async def lookup_by_id(
        self,
        tokens: Tokens,
        *,
        session_id: str | None = None,
        lease_ms: int | None = None,
        explain: bool = False,
        declined: bool = False,
    ) -> LookupResult:
        """``lookup``, sending the ids computed here from the resolved root instead of the
        tokens, with the compact answer: the same result for less work on the server."""
        p = protocol.id_prompt(await self.resolve(), tokens)
        request = protocol.lookup_ids_request(
            self.namespace,
            p,
            session_id=session_id,
            lease_ms=lease_ms,
            explain=explain,
            declined=declined,
        )
        return protocol.parse_compact_lookup(await self._send(request), p)

    async def load(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        """The payloads of ``hashes`` in order (None for a block not held), in batches."""
        out: list[bytes | None] = []
        for chunk in protocol.batch_chunks(hashes):
            out += protocol.parse_batch(await self._send(protocol.batch_request(chunk)), chunk)
        return out

    async def store(
        self,
        tokens: Tokens,
        payloads: PayloadSource,
        *,
        session_id: str | None = None,
        ttl_s: float | None = None,
        durable: bool = False,
        finish_reason: str | None = None,
    ) -> StoreResult:
        """Store the KV of ``tokens``' full blocks: plan with ``POST /v1/store``, then upload
        each block the server lacks. ``payloads`` is a function of the block index or a
        sequence with one payload per full block; only the missing blocks' are read.
        ``durable``: each upload is answered once its block is on disk. ``finish_reason``
        (with ``session_id``): the request whose KV this is has finished, for this reason
        (``tool_use``, ``stop``, ...; see ``finish_session``)."""
        p = self._prompt(await self._effective_namespace(), tokens)
        request = protocol.store_request(
            self.namespace, p, session_id=session_id, ttl_s=ttl_s, finish_reason=finish_reason
        )
        plan = protocol.parse_store(await self._send(request), p)
        loop = protocol.upload_loop(plan)
        while (chunk := loop.next()) is not None:
            h = plan.missing[chunk.start]
            payload = protocol.payload_for(payloads, plan.index[h])
            try:
                up = protocol.parse_upload(
                    await self._send(protocol.upload_request(h, payload, durable=durable))
                )
            except NoRoom:
                up = protocol.DROPPED_UPLOAD
            loop.done([h], [up.status], up.durable)
        return protocol.store_result(plan, loop)

    async def release(self, lease_id: str) -> None:
        """Release a lookup's lease before it expires."""
        await self._send(protocol.release_request(lease_id))

    async def stream(self, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> StreamClient:
        """A (blocking) ``StreamClient`` connected to this node's block stream, found with
        ``GET /v1/dataplane``; it connects in a worker thread. Run its transfers in threads
        too (``asyncio.to_thread``): they block."""
        import asyncio

        address = protocol.parse_dataplane(
            await self._send(protocol.dataplane_request()), self.base_url
        )
        if address is None:
            raise TransportError(f"{self.base_url} serves no block stream")
        return await asyncio.to_thread(
            StreamClient.connect, address, api_key=self._api_key, seed=self.seed, timeout=timeout
        )

    async def same_host(self, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> SameHostClient:
        """A (blocking) ``SameHostClient`` on this node's same-host socket, found with
        ``GET /v1/dataplane``; it connects in a worker thread (see ``stream``)."""
        import asyncio

        path = protocol.parse_same_host(await self._send(protocol.dataplane_request()))
        if path is None or not os.path.exists(path.removeprefix("unix:")):
            raise TransportError(f"{self.base_url} serves no same-host socket on this host")
        return await asyncio.to_thread(
            SameHostClient.connect, path, api_key=self._api_key, seed=self.seed, timeout=timeout
        )

    # -- sessions --------------------------------------------------------------------------

    async def open_session(
        self,
        session_id: str | None = None,
        *,
        kind: str = "agent",
        ttl_s: float | None = None,
        parent: str | None = None,
    ) -> Session:
        """Open a session (or get the caller's open session with that id). ``parent``: the
        caller's session it was forked from (a subagent's): its close spares their prefix."""
        return protocol.parse_session(
            await self._send(protocol.open_session_request(session_id, kind, ttl_s, parent))
        )

    async def get_session(self, session_id: str) -> Session:
        return protocol.parse_session(await self._send(protocol.get_session_request(session_id)))

    async def extend_session(self, session_id: str, *, ttl_s: float | None = None) -> Session:
        """Slide the session's expiry (optionally with a new TTL)."""
        return protocol.parse_session(
            await self._send(protocol.extend_session_request(session_id, ttl_s))
        )

    async def finish_session(self, session_id: str, finish_reason: str) -> Session:
        """The session's latest request finished, for ``finish_reason`` (``tool_use``: the
        agent comes back in seconds; ``stop``, ``end_turn``: minutes or days; ``length``,
        ``abort``): its blocks are kept or evicted by when it is predicted back."""
        return protocol.parse_session(
            await self._send(protocol.finish_session_request(session_id, finish_reason))
        )

    async def hint_session(
        self, session_id: str, hint: Mapping[str, Any], *, block_tokens: int | None = None
    ) -> Session:
        return protocol.parse_session(
            await self._send(protocol.hint_session_request(session_id, hint, block_tokens))
        )

    async def prefetch_session(self, session_id: str) -> Prefetch:
        return protocol.parse_prefetch(
            await self._send(protocol.prefetch_session_request(session_id))
        )

    async def close_session(self, session_id: str) -> None:
        """Close the session: its pins go, its blocks age out by TTL."""
        await self._send(protocol.close_session_request(session_id))

    async def list_sessions(self) -> list[Session]:
        return protocol.parse_sessions(await self._send(protocol.list_sessions_request()))
