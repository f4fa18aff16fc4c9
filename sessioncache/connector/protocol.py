"""Everything the sync and async clients share: request building, response parsing and the id
checks. No I/O here: ``SessionCacheClient`` and ``AsyncSessionCacheClient`` only send the
``Request`` values built here and hand each ``Reply`` back, so the two differ in ``await`` alone.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from sessioncache.connector.results import (
    Lease as Lease,
)
from sessioncache.connector.results import (
    LookupResult as LookupResult,
)
from sessioncache.connector.results import (
    Miss as Miss,
)
from sessioncache.connector.results import (
    MissTotals as MissTotals,
)
from sessioncache.connector.results import (
    PayloadSource as PayloadSource,
)
from sessioncache.connector.results import (
    Prefetch as Prefetch,
)
from sessioncache.connector.results import (
    Resolved as Resolved,
)
from sessioncache.connector.results import (
    Session as Session,
)
from sessioncache.connector.results import (
    StoreResult as StoreResult,
)
from sessioncache.connector.results import (
    WhoAmI as WhoAmI,
)
from sessioncache.connector.storeloop import StoreLoop
from sessioncache.dataplane.frames.batch import decode_batch
from sessioncache.errors import IdMismatch, InvalidInput, ProtocolError, from_http
from sessioncache.hashing import (
    BlockHash,
    Namespace,
    NamespaceRoot,
    Tokens,
    block_hashes_from_bytes,
    namespace_root,
    tenant_namespace,
    tokens_to_le_bytes,
)
from sessioncache.status import BlockStatus

MAX_BATCH = 4096
"""The most ids one ``POST /v1/blocks/batch`` may ask for."""


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    json: dict[str, Any] | None = None
    content: bytes | None = None
    headers: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    headers: Mapping[str, str]
    body: bytes


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt as the wire and the id check need it."""

    tokens_b64: str
    num_tokens: int
    hashes: list[BlockHash]


@dataclass(frozen=True, slots=True)
class IdPrompt:
    """A prompt as a lookup by id sends it: its ids, computed from a resolved root."""

    block_ids_b64: str
    hashes: list[BlockHash]
    block_tokens: int


# -- identity and ids ----------------------------------------------------------------------


def effective_namespace(namespace: Namespace, who: WhoAmI | None) -> Namespace:
    """The namespace the server hashes under: with auth on, the salt is ``"<tenant>"`` or
    ``"<tenant>/<salt>"`` (docs/hashing.md)."""
    return tenant_namespace(namespace, who.tenant if who is not None and who.auth else None)


def prompt(effective: Namespace, tokens: Tokens, seed: int) -> Prompt:
    token_bytes = tokens_to_le_bytes(tokens)
    root = namespace_root(effective, seed)
    return Prompt(
        tokens_b64=base64.b64encode(token_bytes).decode("ascii"),
        num_tokens=len(token_bytes) // 4,
        hashes=block_hashes_from_bytes(root, token_bytes, effective.block_tokens, seed),
    )


def id_prompt(resolved: Resolved, tokens: Tokens) -> IdPrompt:
    """The ids of ``tokens``' full blocks from the server's root for the namespace: exactly
    what the server would compute from the tokens (``sessioncache.hashing``, the same code)."""
    hashes = block_hashes_from_bytes(
        resolved.root, tokens_to_le_bytes(tokens), resolved.block_tokens, resolved.hash_seed
    )
    return IdPrompt(
        block_ids_b64=base64.b64encode(b"".join(hashes)).decode("ascii"),
        hashes=hashes,
        block_tokens=resolved.block_tokens,
    )


def _hex_list(value: object, what: str) -> list[BlockHash]:
    if not isinstance(value, list):
        raise ProtocolError(f"{what}: expected a list of ids")
    out = []
    for item in value:
        if not isinstance(item, str) or len(item) != 32:
            raise ProtocolError(f"{what}: not a block id: {item!r:.80}")
        try:
            out.append(BlockHash(bytes.fromhex(item)))
        except ValueError:
            raise ProtocolError(f"{what}: not a block id: {item!r:.80}") from None
    return out


def _check_ids(theirs: list[BlockHash], ours: list[BlockHash], what: str) -> None:
    if len(theirs) > len(ours):
        raise IdMismatch(f"{what}: the server returned {len(theirs)} ids for {len(ours)} blocks")
    for i, (a, b) in enumerate(zip(theirs, ours, strict=False)):
        if a != b:
            raise IdMismatch(
                f"{what}: block {i} is {a.hex()} on the server but {b.hex()} here; the client and "
                "the server disagree on the hash seed, the namespace or the tenant salt"
            )


# -- replies -------------------------------------------------------------------------------


def check(reply: Reply) -> Reply:
    """The reply itself when it is a success, else the error the answer names raised."""
    if reply.status < 400:
        return reply
    error, detail = "HTTPError", reply.body[:500].decode("utf-8", "replace")
    try:
        body = json.loads(reply.body)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        error = body["error"]
        detail = str(body.get("detail", ""))
    exc = from_http(reply.status, error, detail)
    retry_after = _retry_after(reply.headers)
    if retry_after is not None:
        exc.retry_after = retry_after
    raise exc


def _retry_after(headers: Mapping[str, str]) -> float | None:
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None  # an HTTP date: rare from a cache service; the backoff applies
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _json(reply: Reply) -> dict[str, Any]:
    try:
        body = json.loads(reply.body)
    except ValueError as exc:
        raise ProtocolError(f"not JSON: {reply.body[:200]!r}") from exc
    if not isinstance(body, dict):
        raise ProtocolError("expected a JSON object")
    return body


def _field(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(name)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ProtocolError(f"field {name!r} missing or of the wrong type")
    return value


# -- requests and their parsers ------------------------------------------------------------


def whoami_request() -> Request:
    return Request("GET", "/v1/whoami")


def parse_whoami(reply: Reply) -> WhoAmI:
    body = _json(reply)
    return WhoAmI(tenant=_field(body, "tenant", str), auth=_field(body, "auth", bool))


def _prompt_body(namespace: Namespace, p: Prompt, **optional: object) -> dict[str, Any]:
    """The JSON body of a request about a prompt (lookup, store), with the optional fields
    that are not None."""
    body: dict[str, Any] = {"namespace": namespace.as_json(), "tokens_b64": p.tokens_b64}
    body.update((name, value) for name, value in optional.items() if value is not None)
    return body


def lookup_request(
    namespace: Namespace,
    p: Prompt,
    *,
    session_id: str | None,
    lease_ms: int | None,
    explain: bool = False,
    declined: bool = False,
) -> Request:
    body = _prompt_body(
        namespace,
        p,
        session_id=session_id,
        lease_ms=lease_ms,
        explain=explain or None,
        declined=declined or None,
    )
    return Request("POST", "/v1/lookup", json=body)


def parse_lookup(reply: Reply, p: Prompt) -> LookupResult:
    body = _json(reply)
    blocks = _field(body, "blocks", list)
    if not all(isinstance(b, dict) for b in blocks):
        raise ProtocolError("blocks: expected objects")
    hashes = _hex_list([b.get("hash") for b in blocks], "lookup")
    tiers = [str(b.get("tier", "")) for b in blocks]
    if _field(body, "matched_blocks", int) != len(hashes):
        raise ProtocolError("lookup: matched_blocks does not match the blocks listed")
    _check_ids(hashes, p.hashes, "lookup")
    return LookupResult(
        block_tokens=_field(body, "block_tokens", int),
        hashes=hashes,
        tiers=tiers,
        lease=_lease(body),
        prompt_hashes=p.hashes,
        miss=_miss(body),
    )


def _optional(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    return None if body.get(name) is None else _field(body, name, kind)


def _object(body: Mapping[str, Any], name: str, within: str = "") -> Mapping[str, Any] | None:
    """The JSON object ``body[name]`` (None when null or absent); ``ProtocolError`` when it is
    something else (``within``: what ``body`` is, to prefix the name with in the message)."""
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise ProtocolError(f"{within}{name}: expected an object")
    return value


def _miss(body: Mapping[str, Any]) -> Miss | None:
    miss = _object(body, "miss")
    if miss is None:
        return None
    ago = _optional(miss, "ago_s", (int, float))
    return Miss(
        reason=_optional(miss, "reason", str),
        tokens=_reason_counts(_field(miss, "tokens", dict)),
        block=_optional(miss, "block", int),
        token=_optional(miss, "token", int),
        offset=_optional(miss, "offset", int),
        tier=_optional(miss, "tier", str),
        ago_s=None if ago is None else float(ago),
        pressure=_optional(miss, "pressure", str),
    )


def _reason_counts(counts: Mapping[str, Any]) -> dict[str, int]:
    if not all(isinstance(v, int) for v in counts.values()):
        raise ProtocolError("miss tokens: expected integers")
    return dict(counts)


def _miss_totals(body: Mapping[str, Any]) -> MissTotals | None:
    totals = _object(body, "attribution")
    if totals is None:
        return None
    div = _object(totals, "last_divergence", "attribution: ")
    return MissTotals(
        lookups=_field(totals, "lookups", int),
        hit_tokens=_field(totals, "hit_tokens", int),
        miss_tokens=_reason_counts(_field(totals, "miss_tokens", dict)),
        last_divergence=None
        if div is None
        else (
            _field(div, "block", int),
            _optional(div, "offset", int),
            _field(div, "token", int),
        ),
    )


def _lease(body: Mapping[str, Any]) -> Lease | None:
    lease_body = _object(body, "lease")
    if lease_body is None:
        return None
    return Lease(
        id=_field(lease_body, "id", str),
        expires_at=float(_field(lease_body, "expires_at", (int, float))),
    )


def resolve_request(namespace: Namespace) -> Request:
    return Request("POST", "/v1/namespaces/resolve", json={"namespace": namespace.as_json()})


def parse_resolve(reply: Reply, namespace: Namespace, seed: int) -> Resolved:
    """The server's root for ``namespace``; ``IdMismatch`` when the server hashes with
    another seed than the client's (its ids would never be the client's)."""
    body = _json(reply)
    root = _hex_list([body.get("root")], "resolve: root")[0]
    block_tokens = _field(body, "block_tokens", int)
    if block_tokens != namespace.block_tokens:
        raise ProtocolError(
            f"resolve: the server answered block_tokens={block_tokens} for a namespace of "
            f"{namespace.block_tokens}"
        )
    hash_seed = _field(body, "hash_seed", int)
    if hash_seed != seed:
        raise IdMismatch(
            f"the server hashes with seed {hash_seed}, this client with seed {seed}: set the "
            "client's seed to the service's SESSIONCACHE_HASH_SEED"
        )
    return Resolved(namespace, NamespaceRoot(root), block_tokens, hash_seed)


def lookup_ids_request(
    namespace: Namespace,
    p: IdPrompt,
    *,
    session_id: str | None,
    lease_ms: int | None,
    explain: bool = False,
    declined: bool = False,
) -> Request:
    """A lookup by id with the compact answer (the client has the ids already)."""
    body: dict[str, Any] = {
        "namespace": namespace.as_json(),
        "block_ids_b64": p.block_ids_b64,
        "compact": True,
    }
    if session_id is not None:
        body["session_id"] = session_id
    if lease_ms is not None:
        body["lease_ms"] = lease_ms
    if explain:
        body["explain"] = True
    if declined:
        body["declined"] = True
    return Request("POST", "/v1/lookup", json=body)


def parse_compact_lookup(reply: Reply, p: IdPrompt) -> LookupResult:
    """A compact lookup answer: the matched blocks are the first ``matched_blocks`` of the
    ids sent; their tiers come run-length encoded."""
    body = _json(reply)
    matched = _field(body, "matched_blocks", int)
    if not 0 <= matched <= len(p.hashes):
        raise ProtocolError(f"lookup: {matched} blocks matched of the {len(p.hashes)} ids sent")
    block_tokens = _field(body, "block_tokens", int)
    if block_tokens != p.block_tokens:
        raise ProtocolError(f"lookup: block_tokens={block_tokens}, expected {p.block_tokens}")
    tiers: list[str] = []
    for run in _field(body, "tiers", list):
        if not isinstance(run, dict):
            raise ProtocolError("lookup: tiers: expected objects")
        count = _field(run, "blocks", int)
        if not 0 < count <= matched - len(tiers):
            raise ProtocolError(f"lookup: tiers: a run of {count} blocks")
        tiers += [_field(run, "tier", str)] * count
    if len(tiers) != matched:
        raise ProtocolError(
            f"lookup: the tier runs cover {len(tiers)} blocks, matched_blocks is {matched}"
        )
    return LookupResult(
        block_tokens=block_tokens,
        hashes=p.hashes[:matched],
        tiers=tiers,
        lease=_lease(body),
        prompt_hashes=p.hashes,
        miss=_miss(body),
    )


def release_request(lease_id: str) -> Request:
    return Request("DELETE", f"/v1/leases/{_path_part(lease_id)}")


def store_request(
    namespace: Namespace,
    p: Prompt,
    *,
    session_id: str | None,
    ttl_s: float | None,
    finish_reason: str | None = None,
) -> Request:
    body = _prompt_body(
        namespace, p, session_id=session_id, ttl_s=ttl_s, finish_reason=finish_reason
    )
    return Request("POST", "/v1/store", json=body)


@dataclass(frozen=True, slots=True)
class UploadPlan:
    """The node's answer to ``POST /v1/store`` (its ``operations.stores.UploadPlan``), as
    the client checked it: every id of the prompt, the missing ones, and each id's place."""

    block_tokens: int
    hashes: list[BlockHash]
    missing: list[BlockHash]
    index: dict[BlockHash, int]


def parse_store(reply: Reply, p: Prompt) -> UploadPlan:
    body = _json(reply)
    hashes = _hex_list(body.get("hashes"), "store")
    missing = _hex_list(body.get("missing"), "store")
    _check_ids(hashes, p.hashes, "store")
    if len(hashes) != len(p.hashes):
        raise IdMismatch(f"store: the server has {len(hashes)} blocks, the client {len(p.hashes)}")
    index = {h: i for i, h in enumerate(hashes)}
    if any(h not in index for h in missing):
        raise ProtocolError("store: a missing id that is not one of the prompt's")
    return UploadPlan(_field(body, "block_tokens", int), hashes, missing, index)


def payload_for(source: PayloadSource, index: int) -> bytes:
    """Block ``index``'s payload from a store's payload source, as non-empty bytes."""
    if callable(source):
        data = source(index)
    else:
        if index >= len(source):
            raise InvalidInput(
                f"no payload for block {index}: the sequence has {len(source)} (one per full "
                "block of the prompt, in order)"
            )
        data = source[index]
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidInput(f"payload of block {index} is {type(data).__name__}, not bytes")
    data = bytes(data)
    if not data:
        raise InvalidInput(f"payload of block {index} is empty")
    return data


def upload_request(block_hash: BlockHash, payload: bytes, *, durable: bool = False) -> Request:
    return Request(
        "PUT",
        f"/v1/blocks/{block_hash.hex()}" + ("?durable=true" if durable else ""),
        content=payload,
        headers={"content-type": "application/octet-stream"},
    )


@dataclass(frozen=True, slots=True)
class Upload:
    status: BlockStatus
    durable: bool


DROPPED_UPLOAD = Upload(BlockStatus.DROPPED, False)
"""What a block the node had no room for (507 ``NoRoom``) counts as, and every block after it:
their uploads are not sent (they would hang off a block the node does not hold)."""


def parse_upload(reply: Reply) -> Upload:
    body = _json(reply)
    name = _field(body, "status", str)
    try:
        status = BlockStatus(name)
    except ValueError:
        raise ProtocolError(f"upload: unknown block status {name!r:.40}") from None
    if not status.held:
        raise ProtocolError(f"upload: a 2xx answer with status {name!r}")
    return Upload(status, durable=_field(body, "durable", bool))


def upload_loop(plan: UploadPlan) -> StoreLoop:
    """The store loop over a plan's missing blocks, one upload each: once one is dropped
    (``NoRoom``), the rest hang off a block the node does not hold and are not sent."""
    return StoreLoop(len(plan.missing), per=1)


def store_result(plan: UploadPlan, loop: StoreLoop) -> StoreResult:
    loop.drop_rest([plan.missing[i] for i in loop.rest])
    status = [BlockStatus.PRESENT] * len(plan.hashes)
    for block_hash, block_status in zip(loop.ids, loop.status, strict=True):
        status[plan.index[BlockHash(block_hash)]] = block_status
    return StoreResult(
        block_tokens=plan.block_tokens,
        hashes=plan.hashes,
        missing=plan.missing,
        stored=loop.status.count(BlockStatus.STORED),
        durable=loop.durable,
        status=status,
    )


def batch_chunks(hashes: Sequence[bytes]) -> list[list[BlockHash]]:
    """Ids to read, in chunks of at most ``MAX_BATCH``."""
    ids = []
    for h in hashes:
        if not isinstance(h, bytes) or len(h) != 16:
            raise InvalidInput(f"a block id is 16 bytes, got {h!r:.80}")
        ids.append(BlockHash(h))
    return [ids[i : i + MAX_BATCH] for i in range(0, len(ids), MAX_BATCH)]


def batch_request(chunk: Sequence[BlockHash]) -> Request:
    return Request("POST", "/v1/blocks/batch", json={"hashes": [h.hex() for h in chunk]})


def parse_batch(reply: Reply, chunk: Sequence[BlockHash]) -> list[bytes | None]:
    try:
        records = decode_batch(reply.body)
    except InvalidInput as exc:
        raise ProtocolError(f"block batch: {exc}") from exc
    if [r[0] for r in records] != list(chunk):
        raise ProtocolError("block batch: the records do not answer the ids asked, in order")
    return [payload for _, payload in records]


def dataplane_request() -> Request:
    return Request("GET", "/v1/dataplane")


_WILDCARDS = {"0.0.0.0", "::", ""}


def parse_dataplane(reply: Reply, base_url: str) -> str | None:
    """The node's block-stream address (None when it serves none); a wildcard bind address
    (``0.0.0.0``) stands for the host of ``base_url``."""
    stream = _json(reply).get("stream")
    if stream is None:
        return None
    if not isinstance(stream, str) or ":" not in stream:
        raise ProtocolError(f"stream: not host:port: {stream!r:.80}")
    host, _, port = stream.rpartition(":")
    if host.strip("[]") in _WILDCARDS:
        host = urlsplit(base_url).hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
    return f"{host}:{port}"


def parse_same_host(reply: Reply) -> str | None:
    """The path of the node's same-host socket (None when it serves none)."""
    path = _json(reply).get("same_host")
    if path is None:
        return None
    if not isinstance(path, str) or not path:
        raise ProtocolError(f"same_host: not a socket path: {path!r:.80}")
    return path


def _path_part(value: str) -> str:
    if not value or "/" in value or any(c.isspace() for c in value):
        raise InvalidInput(f"not a valid id: {value!r:.80}")
    return value


def open_session_request(
    session_id: str | None, kind: str, ttl_s: float | None, parent: str | None = None
) -> Request:
    body: dict[str, Any] = {"kind": kind}
    if session_id is not None:
        body["session_id"] = session_id
    if ttl_s is not None:
        body["ttl_s"] = ttl_s
    if parent is not None:
        body["parent"] = parent
    return Request("POST", "/v1/sessions", json=body)


def get_session_request(session_id: str) -> Request:
    return Request("GET", f"/v1/sessions/{_path_part(session_id)}")


def extend_session_request(session_id: str, ttl_s: float | None) -> Request:
    body: dict[str, Any] = {} if ttl_s is None else {"ttl_s": ttl_s}
    return Request("POST", f"/v1/sessions/{_path_part(session_id)}/extend", json=body)


def finish_session_request(session_id: str, finish_reason: str) -> Request:
    body = {"finish_reason": finish_reason}
    return Request("POST", f"/v1/sessions/{_path_part(session_id)}/finish", json=body)


def hint_session_request(
    session_id: str, hint: Mapping[str, Any], block_tokens: int | None = None
) -> Request:
    body = dict(hint) if block_tokens is None else {**hint, "block_tokens": block_tokens}
    return Request("POST", f"/v1/sessions/{_path_part(session_id)}/hints", json=body)


def prefetch_session_request(session_id: str) -> Request:
    return Request("POST", f"/v1/sessions/{_path_part(session_id)}/prefetch")


def parse_prefetch(reply: Reply) -> Prefetch:
    body = _json(reply)
    outcome = _field(body, "outcome", str)
    if outcome not in ("accepted", "deferred", "rejected"):
        raise ProtocolError(f"prefetch: unknown outcome {outcome!r}")
    return Prefetch(outcome, _field(body, "reason", str), _field(body, "blocks", int))


def close_session_request(session_id: str) -> Request:
    return Request("DELETE", f"/v1/sessions/{_path_part(session_id)}")


def list_sessions_request() -> Request:
    return Request("GET", "/v1/sessions")


def _session(body: Mapping[str, Any]) -> Session:
    head = body.get("head")
    return Session(
        id=_field(body, "id", str),
        tenant=_field(body, "tenant", str),
        kind=_field(body, "kind", str),
        ttl_s=float(_field(body, "ttl_s", (int, float))),
        created=float(_field(body, "created", (int, float))),
        last_seen=float(_field(body, "last_seen", (int, float))),
        expires_at=float(_field(body, "expires_at", (int, float))),
        head=None if head is None else _hex_list([head], "session head")[0],
        pinned=_field(body, "pinned", bool),
        attribution=_miss_totals(body),
    )


def parse_session(reply: Reply) -> Session:
    return _session(_json(reply))


def parse_sessions(reply: Reply) -> list[Session]:
    sessions = _field(_json(reply), "sessions", list)
    if not all(isinstance(s, dict) for s in sessions):
        raise ProtocolError("sessions: expected objects")
    return [_session(s) for s in sessions]
