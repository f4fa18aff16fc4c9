"""``StreamClient``: the engine's end of the data plane (blocking, one connection).

    client = StreamClient.connect("127.0.0.1:8081", api_key=key)   # or discover(rest_url)
    root = client.resolve(namespace)
    ids = client.block_hashes(root, tokens)
    found = client.lookup(root, ids, lease_ms=5000)               # leased prefix
    client.load_into(found, [kv[i] for i in range(found.matched)], release=True)
    client.store(root, tokens_after, payloads, parent=found.hashes[-1])

Payloads go from and to the caller's memory without Python copies: ``load_into`` receives
each block with ``recv_into`` straight into the buffers it is given (numpy arrays, CPU torch
tensors, bytearrays or writable memoryviews, each exactly one block long; a CUDA tensor's block
is received into a pinned buffer and copied to its device asynchronously, every copy complete
before ``load_into`` returns, ``sessioncache.devices``), and ``store`` hands the payloads' own
buffers to the kernel. Ids are derived here with the node's code
(``sessioncache.hashing``) and every id or root the node answers is checked against them:
a mismatch (another hash seed, namespace or tenant salt) raises ``IdMismatch``.

One client is one connection; its calls are serialized by a lock (use one client per thread
for parallel transfers). An error the node reports is raised as the class its code has in
``sessioncache.errors.TABLE`` (``from_stream``); after a broken connection every call raises
``StreamClosed`` (connect again).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple, Self, TypedDict, Unpack

from sessioncache.connector import protocol
from sessioncache.connector.connection import StreamConnection
from sessioncache.connector.errors import IdMismatch, ProtocolError
from sessioncache.connector.payloads import (
    as_buffer,
    key_bytes,
    one_size,
    segment_ids,
    store_tokens,
    store_ttl_ms,
)
from sessioncache.connector.sessioncalls import SessionCalls
from sessioncache.connector.storeloop import StoreLoop
from sessioncache.dataplane import frames
from sessioncache.dataplane.frames import (
    Hello,
    Limits,
    LoadIds,
    LoadLease,
    Lookup,
    Op,
    StoreHead,
)
from sessioncache.dataplane.transport import Transport, connect
from sessioncache.devices import DeviceCopies, HostBounce, device_bytes, on_device
from sessioncache.errors import (
    InvalidInput,
    PayloadSizeError,
    StreamClosed,
)
from sessioncache.hashing import (
    Namespace,
    Tokens,
    block_hashes_from_bytes,
    keyed_block_ids,
    namespace_root,
    tenant_namespace,
    tokens_to_le_bytes,
)
from sessioncache.status import BlockStatus, kept

__all__ = ["StoreAck", "StreamClient", "StreamLookup", "discover"]


class StreamLookup(NamedTuple):
    """The held prefix of a LOOKUP's ids that the caller may read."""

    root: bytes
    hashes: list[bytes]
    """The matched ids, a prefix of those asked."""
    nbytes: list[int]
    """Each matched block's payload size."""
    tiers: list[str]
    """Each matched block's fastest tier."""
    lease: bytes | None
    """The lease pinning the match (None without ``lease_ms`` or without a match)."""
    miss: protocol.Miss | None = None
    """Why the rest missed (``explain=True``), as the REST API's ``LookupResult.miss``."""

    @property
    def matched(self) -> int:
        return len(self.hashes)


class StoreAck(NamedTuple):
    """What a STORE did with each block."""

    hashes: list[bytes]
    """Every block's id (checked against the client's own)."""
    status: list[BlockStatus]
    """Per block: ``stored``, ``present`` (already held), ``dropped`` (no room) or, over
    shared memory, ``rejected`` (its slot did not hold what was written)."""
    durable: bool
    """Stored blocks were on a durable tier before the answer."""

    def tally(self, status: BlockStatus) -> int:
        """How many blocks have ``status``."""
        return sum(1 for s in self.status if s == status)

    @property
    def stored(self) -> int:
        return self.tally(BlockStatus.STORED)

    @property
    def held(self) -> list[bool]:
        """Per block: the node holds it after the store (stored or present)."""
        return [s.held for s in self.status]

    @property
    def kept(self) -> int:
        """How many blocks from the first the node holds after the store."""
        return kept(self.status)


def _dataplane(rest_url: str, api_key: str | None, timeout: float) -> protocol.Reply:
    """``GET /v1/dataplane`` of the node at ``rest_url``, checked."""
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{rest_url.rstrip('/')}/v1/dataplane", headers=headers, timeout=timeout)
    return protocol.check(protocol.Reply(r.status_code, r.headers, r.content))


def discover(rest_url: str, *, api_key: str | None = None, timeout: float = 10.0) -> str:
    """The stream address of the node at ``rest_url`` (``GET /v1/dataplane``); a wildcard
    bind address (``0.0.0.0``) is replaced by the REST URL's host."""
    address = protocol.parse_dataplane(_dataplane(rest_url, api_key, timeout), rest_url)
    if address is None:
        raise StreamClosed(f"the node at {rest_url} serves no block stream")
    return address


def discover_same_host(rest_url: str, *, api_key: str | None = None, timeout: float = 10.0) -> str:
    """The path of the same-host socket of the node at ``rest_url`` (``GET /v1/dataplane``)."""
    path = protocol.parse_same_host(_dataplane(rest_url, api_key, timeout))
    if path is None:
        raise StreamClosed(f"the node at {rest_url} serves no same-host socket")
    return path


class HelloOptions(TypedDict, total=False):
    """A data-plane client's options: the API key (none on an open node), the hash seed (the
    node's ``SESSIONCACHE_HASH_SEED``, default 0) and the socket timeout (default 30 s)."""

    api_key: str | None
    seed: int
    timeout: float | None


class StreamClient(SessionCalls[StreamConnection]):
    """A connection to one node's data plane (see the module docstring and ``SessionCalls``)."""

    client_name: ClassVar[str] = "sessioncache-stream/1"
    """How the client names itself in its HELLO."""
    segment_bytes: ClassVar[int | None] = None
    """Most payload bytes one store request carries (None: ``max_ids`` blocks)."""

    def __init__(self, transport: Transport, **options: Unpack[HelloOptions]) -> None:
        api_key = options.get("api_key")
        self._c = StreamConnection(transport, options.get("timeout", 30.0))
        self.seed = options.get("seed", 0)
        self._namespaces: dict[bytes, Namespace] = {}
        try:
            ok = self._c.call(
                Op.HELLO, lambda rid: frames.encode_hello(rid, Hello(api_key, self.client_name))
            )
        except BaseException:
            self._c.transport.close()
            raise
        hello = frames.decode_hello_ok(ok)
        self.tenant, self.auth, self.tiers = hello.tenant, hello.auth, hello.tiers
        self.version = hello.version
        self._c.limits = hello.limits

    @property
    def limits(self) -> Limits:
        """The node's limits, from its HELLO_OK."""
        return self._c.limits

    _find = staticmethod(discover)
    """How ``discover`` finds the address from the REST API (``GET /v1/dataplane``)."""

    @classmethod
    def connect(cls, address: str, **options: Unpack[HelloOptions]) -> Self:
        """Connect to ``host:port``, ``unix:<path>`` or an absolute socket path and say
        HELLO."""
        return cls(connect(address, timeout=options.get("timeout", 30.0)), **options)

    @classmethod
    def discover(cls, rest_url: str, **options: Unpack[HelloOptions]) -> Self:
        """Connect to the node whose REST API is at ``rest_url``: its stream, or for a
        ``SameHostClient`` its same-host socket (the node must then run on this host)."""
        return cls.connect(cls._find(rest_url, api_key=options.get("api_key")), **options)

    def close(self) -> None:
        self._c.close()

    @property
    def broken(self) -> bool:
        """The connection is unusable (closed, or broken by an error): connect again."""
        return self._c.broken is not None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StreamClient({self._c.transport.peer!r}, tenant={getattr(self, 'tenant', None)!r})"

    # -- ids -------------------------------------------------------------------------------

    def resolve(self, namespace: Namespace) -> bytes:
        """The caller's root of ``namespace`` (checked against the client's own derivation);
        LOOKUPs and STOREs on this connection name it."""
        for root, known in self._namespaces.items():
            if known == namespace:
                return root
        body = self._c.call(Op.RESOLVE, lambda rid: frames.encode_resolve(rid, namespace))
        root = frames.decode_resolve_ok(body)
        effective = tenant_namespace(namespace, self.tenant if self.auth else None)
        if root != namespace_root(effective, self.seed):
            raise IdMismatch(
                f"the node's root of {namespace.model!r} is {root.hex()}, not the client's; "
                "they disagree on the hash seed, the namespace or the tenant salt"
            )
        self._namespaces[root] = namespace
        return root

    def block_hashes(
        self, root: bytes, tokens: Tokens, *, parent: bytes | None = None
    ) -> list[bytes]:
        """The ids of the full blocks of ``tokens`` under ``root``, continuing the chain from
        ``parent`` (default: from the root)."""
        namespace = self._namespace(root)
        start = parent if parent is not None else root
        return list(
            block_hashes_from_bytes(
                start, tokens_to_le_bytes(tokens), namespace.block_tokens, self.seed
            )
        )

    def _namespace(self, root: bytes) -> Namespace:
        namespace = self._namespaces.get(root)
        if namespace is None:
            raise InvalidInput(f"root {root.hex()} was not resolved on this connection")
        return namespace

    # -- LOOKUP and RELEASE ----------------------------------------------------------------

    def key_ids(self, root: bytes, keys: Sequence[bytes]) -> list[bytes]:
        """The ids of keyed blocks under ``root`` (``hashing.keyed_block_ids``): 16-byte
        block keys (``hashing.block_key`` of an engine's key) in, ids out, no request."""
        self._namespace(root)
        return list(keyed_block_ids(root, keys, self.seed))

    def exists(self, root: bytes, ids: Sequence[bytes], *, counted: bool = True) -> list[bool]:
        """For each id, whether the node holds it under ``root`` (each on its own, keyed or
        chained; nothing touched nor leased). ``counted``: the question of a prompt (its ids
        count as hit or miss tokens); False for a probe."""
        self._namespace(root)
        out: list[bool] = []
        per = self._c.limits.max_ids
        for first in range(0, len(ids), per):
            request = frames.Exists(root, list(ids[first : first + per]), counted)
            body = self._c.call(Op.EXISTS, functools.partial(frames.encode_exists, exists=request))
            held = frames.decode_exists_ok(body)
            if len(held) != len(request.ids):
                raise ProtocolError(f"EXISTS_OK: {len(held)} answers for {len(request.ids)} ids")
            out += held
        return out

    def lookup(
        self,
        root: bytes,
        ids: Sequence[bytes],
        *,
        lease_ms: int | None = None,
        keyed: bool = False,
        session_id: str | None = None,
        counted: bool = True,
        explain: bool = False,
        declined: bool = False,
    ) -> StreamLookup:
        """The longest held prefix of ``ids`` (a chain under ``root``; with ``keyed``, keyed
        ids each held under ``root``) the caller may read; with ``lease_ms`` it stays pinned
        that long (``release`` it, or load with ``release=True``). ``session_id``: on behalf
        of that open session (its TTL, chain pins, head and totals, as over REST).
        ``counted=False``: a probe, left out of the hit and miss tokens. ``explain``: the
        answer's ``miss`` says why the rest missed. ``declined``: the caller will load
        nothing (its engine cannot continue from a cached context): nothing matches, and the
        node counts the tokens it holds as missed for that reason (data-plane version 4:
        ``ProtocolError`` on an older node, before anything is sent)."""
        self._namespace(root)
        if declined and self.version < frames.DECLINED_VERSION:
            raise ProtocolError(
                f"the node speaks data-plane version {self.version}; a declined lookup needs "
                f"version {frames.DECLINED_VERSION}, a later release of the node"
            )
        if not ids:
            return StreamLookup(root, [], [], [], None)
        if len(ids) > self._c.limits.max_ids:
            raise InvalidInput(f"{len(ids)} ids; the node takes {self._c.limits.max_ids} at most")
        request = Lookup(
            root, list(ids), lease_ms or 0, keyed, session_id, counted, explain, declined
        )
        body = self._c.call(Op.LOOKUP, lambda rid: frames.encode_lookup(rid, request))
        ok = frames.decode_lookup_ok(body)
        n = len(ok.nbytes)
        if n > len(ids):
            raise ProtocolError(f"LOOKUP_OK: {n} blocks matched of {len(ids)} asked")
        tiers = [self._tier(t) for t in ok.tiers]
        miss = self._miss(ok.miss) if ok.miss is not None else None
        return StreamLookup(root, [bytes(h) for h in ids[:n]], ok.nbytes, tiers, ok.lease, miss)

    def _tier(self, index: int) -> str:
        if index >= len(self.tiers):
            self._c.fail(f"tier {index} of a node that named {len(self.tiers)}")
        return self.tiers[index]

    def _miss(self, miss: frames.Miss) -> protocol.Miss:
        if (miss.reason is not None and miss.reason >= len(frames.MISS_REASONS)) or (
            miss.pressure is not None and miss.pressure >= len(frames.MISS_PRESSURES)
        ):
            self._c.fail(f"LOOKUP_OK: a miss section with unknown codes: {miss}")
        first = miss.reason is not None
        return protocol.Miss(
            reason=frames.MISS_REASONS[miss.reason] if miss.reason is not None else None,
            # a node of a version before DECLINED_VERSION sends no declined count
            tokens={
                r: miss.tokens[i] if i < len(miss.tokens) else 0
                for i, r in enumerate(frames.MISS_REASONS)
            },
            block=miss.block if first else None,
            token=miss.token if first else None,
            offset=miss.offset,
            tier=self._tier(miss.tier) if miss.tier is not None else None,
            ago_s=miss.ago_s,
            pressure=frames.MISS_PRESSURES[miss.pressure] if miss.pressure is not None else None,
        )

    def release(self, lease: StreamLookup | bytes) -> None:
        """Release a lookup's lease (``LeaseNotFound`` once released or expired)."""
        key = lease.lease if isinstance(lease, StreamLookup) else lease
        if key is None:
            return
        self._c.call(Op.RELEASE, lambda rid: frames.encode_release(rid, key))

    # -- LOAD ------------------------------------------------------------------------------

    def load_into(
        self,
        source: StreamLookup | bytes | Sequence[bytes],
        out: Sequence[Any],
        *,
        start: int = 0,
        release: bool = False,
        each: bool = False,
        session_id: str | None = None,
    ) -> list[bool]:
        """Receive blocks straight into ``out`` (one exactly block-sized buffer each); returns
        which were found. ``source`` is a lookup (its lease, from block ``start``; without a
        lease, its ids), a lease id, or a list of ids (their held prefix is leased while it
        is sent; past it, blocks are missing; with ``each``, every held id is sent, as keyed
        blocks want). ``release`` ends the lease after the load. ``session_id``: a load by
        ids on behalf of that session (a lease's lookup named its own)."""
        views: list[Any] = [
            device_bytes(o, o.nbytes) if on_device(o) else as_buffer(o, writable=True) for o in out
        ]
        if not views:
            return []
        return self._load(source, len(views), start, release, views, each=each, session=session_id)

    def load(
        self, source: StreamLookup | bytes | Sequence[bytes], *, blocks: int | None = None
    ) -> list[bytes | None]:
        """The payloads as new ``bytes`` (None when missing): for tests and small reads;
        ``load_into`` is the fast path. ``blocks`` counts a lease id's blocks to read."""
        if isinstance(source, StreamLookup):
            n = source.matched
        elif isinstance(source, bytes):
            if blocks is None:
                raise InvalidInput("loading by a lease id needs the number of blocks")
            n = blocks
        else:
            n = len(source)
        if n == 0:
            return []
        got: list[bytes | None] = []
        self._load(source, n, 0, False, None, got)
        return got

    def _load(
        self,
        source: StreamLookup | bytes | Sequence[bytes],
        n: int,
        start: int,
        release: bool,
        views: list[Any] | None,
        got: list[bytes | None] | None = None,
        *,
        each: bool = False,
        session: str | None = None,
    ) -> list[bool]:
        if isinstance(source, StreamLookup) and source.lease is not None:
            request: LoadLease | LoadIds = LoadLease(source.lease, start, n, release)
        elif isinstance(source, bytes):
            request = LoadLease(source, start, n, release)
        else:
            ids = source.hashes if isinstance(source, StreamLookup) else source
            if len(ids) - start < n:
                raise InvalidInput(f"{n} buffers for {len(ids) - start} ids")
            request = LoadIds(list(ids[start : start + n]), each, session)
        if n > self._c.limits.max_ids:
            raise InvalidInput(f"{n} blocks; the node sends {self._c.limits.max_ids} at most")
        with self._c.lock, DeviceCopies() as copies:
            bounce = HostBounce(copies)  # device buffers' blocks arrive here first
            rid = self._c.send(frames.encode_load(self._c.next_rid(), request))
            found: list[bool] = []
            wrong: str | None = None
            for i in range(n):
                header = self._c.read_header(rid, Op.BLOCK)
                if header.flags & frames.F_BLOCK_MISSING:
                    if header.body_len:
                        self._c.fail("BLOCK: a missing block with a body")
                    found.append(False)
                    if got is not None:
                        got.append(None)
                    continue
                if views is None:
                    buf = bytearray(header.body_len)
                    self._c.recv(memoryview(buf))
                    assert got is not None
                    got.append(bytes(buf))
                elif header.body_len == views[i].nbytes:
                    if on_device(views[i]):
                        host = bounce.buffer(header.body_len)
                        self._c.recv(host.numpy().data)
                        bounce.upload(views[i])
                    else:
                        self._c.recv(views[i])
                else:
                    # Keep the stream in step, and say so once every block is read.
                    self._c.drain(header.body_len)
                    wrong = wrong or (
                        f"block {start + i} is {header.body_len} bytes but its buffer "
                        f"{views[i].nbytes}"
                    )
                found.append(True)
        if wrong is not None:
            raise PayloadSizeError(wrong)
        return found

    # -- STORE -----------------------------------------------------------------------------

    def store(
        self,
        root: bytes,
        tokens: Tokens,
        payloads: Sequence[Any],
        *,
        parent: bytes | None = None,
        ttl_s: float | None = None,
        session_id: str | None = None,
        durable: bool = False,
        finish_reason: str | None = None,
    ) -> StoreAck:
        """Store a chain segment under ``root``: one payload per full block of ``tokens``
        (exactly), continuing from ``parent`` (a held block of this root; default: the root
        itself). The node derives the ids; each block is published only once its whole
        payload arrived. More blocks than one request carries go in several.
        ``session_id``: on behalf of that open session (its TTL at least; its chain, pins and
        head end at the last block kept). ``durable``: answered once the blocks are on disk
        (else once the node's first tier holds them; ``StoreAck.durable`` says which).
        ``finish_reason`` (with ``session_id``): why the request of this KV finished."""
        namespace = self._namespace(root)
        token_bytes = store_tokens(namespace, tokens, len(payloads))
        return self._store(
            root,
            namespace.block_tokens,
            token_bytes,
            payloads,
            parent,
            ttl_s,
            session=session_id,
            durable=durable,
            finish=finish_reason,
        )

    def store_keyed(
        self,
        root: bytes,
        keys: Sequence[bytes],
        payloads: Sequence[Any],
        *,
        parent: bytes | None = None,
        linked: bool = True,
        ttl_s: float | None = None,
        durable: bool = False,
        session_id: str | None = None,
        finish_reason: str | None = None,
    ) -> StoreAck:
        """Store keyed blocks under ``root``: one payload per 16-byte block key
        (``hashing.block_key``); their ids are ``key_ids(root, keys)``. ``linked`` records the
        batch as a chain (block ``i`` hangs off block ``i - 1``, block 0 off ``parent`` when
        given), for tail-first eviction; else each block stands alone. ``parent`` is a block
        of ``root``, or of a related group's root (``Namespace.related``: a hybrid model's
        companion objects hang off its spine's chain). ``durable``, ``session_id`` and
        ``finish_reason`` as in ``store``."""
        self._namespace(root)
        if len(keys) != len(payloads):
            raise InvalidInput(f"{len(keys)} keys for {len(payloads)} payloads")
        return self._store(
            root,
            frames.KEY_WORDS,
            key_bytes(keys),
            payloads,
            parent,
            ttl_s,
            keyed=True,
            linked=linked,
            session=session_id,
            durable=durable,
            finish=finish_reason,
        )

    def _store(
        self,
        root: bytes,
        block_tokens: int,
        token_bytes: bytes,
        payloads: Sequence[Any],
        parent: bytes | None,
        ttl_s: float | None,
        *,
        keyed: bool = False,
        linked: bool = True,
        session: str | None = None,
        durable: bool = False,
        finish: str | None = None,
    ) -> StoreAck:
        """The store loop of both data-plane clients (``StoreLoop``): one segment of at most
        ``max_ids`` blocks at a time, sent by ``_store_segment`` (each with ``finish``)."""
        if not payloads:
            return StoreAck([], [], False)
        items, size = self._store_payloads(payloads)
        step = 4 * block_tokens
        ttl_ms = store_ttl_ms(ttl_s)
        per = self._c.limits.max_ids
        if self.segment_bytes is not None:
            per = max(1, min(per, self.segment_bytes // max(size, 1)))
        loop = StoreLoop(len(items), per=per, parent=parent, linked=linked)
        while (chunk := loop.next()) is not None:
            head = StoreHead(
                root,
                loop.parent,
                block_tokens,
                len(chunk),
                size,
                ttl_ms,
                keyed,
                linked,
                session,
                durable,
                finish,
            )
            segment = token_bytes[chunk.start * step : chunk.stop * step]
            ours = segment_ids(head, segment, self.seed)
            loop.done(*self._store_segment(head, segment, ours, items[chunk.start : chunk.stop]))
        if loop.rest:
            head = StoreHead(root, loop.ids[-1], block_tokens, 0, size, ttl_ms, keyed, linked)
            loop.drop_rest(segment_ids(head, token_bytes[loop.rest.start * step :], self.seed))
        return StoreAck(loop.ids, loop.status, loop.durable)

    def _store_payloads(self, payloads: Sequence[Any]) -> tuple[Sequence[Any], int]:
        """The payloads as this carrier sends them, and their one size."""
        views = [as_buffer(p, writable=False) for p in payloads]
        return views, one_size(v.nbytes for v in views)

    def _store_segment(
        self, head: StoreHead, segment: bytes, ours: list[bytes], part: Sequence[Any]
    ) -> tuple[list[bytes], list[BlockStatus], bool]:
        """One STORE: its blocks' ids as the node derived them (``ours`` or ``IdMismatch``),
        their statuses, and whether they are on a durable tier."""
        encode = functools.partial(frames.encode_store_head, head=head, token_bytes=segment)
        body = self._c.call(Op.STORE, encode, payloads=part)
        ok = frames.decode_store_ok(body)
        if ok.ids != ours:
            raise IdMismatch("STORE: the node derived other ids than the client")
        return ok.ids, ok.status, ok.durable
