"""HELLO, RESOLVE, RELEASE and ERROR frames (sans I/O)."""

from __future__ import annotations

import json
import struct
from typing import Any, NamedTuple

from sessioncache.dataplane.frames.header import (
    F_ERROR_CLOSING,
    F_RELEASE_CHECK,
    F_RELEASE_LIVE,
    FRAME_VERSION,
    MAX_MESSAGE,
    VERSION,
    VERSIONS,
    Limits,
    Op,
    VersionError,
    fixed_part,
    frame,
)
from sessioncache.errors import FrameError, InvalidInput
from sessioncache.hashing import HASH_BYTES, Namespace, check_client_namespace

# -- JSON bodies (HELLO, RESOLVE, HELLO_OK) ------------------------------------------------


def _json_body(data: bytes, what: str) -> dict[str, Any]:
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise FrameError(f"{what}: the body is not JSON") from None
    except RecursionError:
        raise FrameError(f"{what}: the body nests too deep") from None
    if not isinstance(body, dict):
        raise FrameError(f"{what}: the body is not a JSON object")
    return body


def _json_frame(opcode: Op, request_id: int, body: dict[str, Any]) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    return frame(opcode, request_id, data)


class Hello(NamedTuple):
    """HELLO (JSON ``{"api_key": str | null, "client": str, "versions": [int]}``): the first
    frame of a connection. The node maps the key to a tenant exactly as the REST API does, and
    answers in the highest of ``versions`` it speaks (or refuses, closing)."""

    api_key: str | None
    client: str = ""
    versions: tuple[int, ...] = tuple(sorted(VERSIONS))


def encode_hello(request_id: int, hello: Hello) -> bytes:
    body = {"api_key": hello.api_key, "client": hello.client, "versions": list(hello.versions)}
    return _json_frame(Op.HELLO, request_id, body)


def decode_hello(data: bytes) -> Hello:
    body = _json_body(data, "HELLO")
    key = body.get("api_key")
    client = body.get("client", "")
    versions = body.get("versions", [FRAME_VERSION])  # a HELLO from before the list
    if key is not None and not isinstance(key, str):
        raise FrameError("HELLO: api_key must be a string or null")
    if not isinstance(client, str):
        raise FrameError("HELLO: client must be a string")
    if not isinstance(versions, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in versions
    ):
        raise FrameError("HELLO: versions must be a list of integers")
    return Hello(key, client, tuple(versions))


def negotiate(hello: Hello, speaks: frozenset[int] = VERSIONS) -> int:
    """The version a node that ``speaks`` these answers a HELLO in: the highest both ends
    speak."""
    common = speaks.intersection(hello.versions)
    if not common:
        raise VersionError(max(hello.versions, default=0))
    return max(common)


class HelloOk(NamedTuple):
    """HELLO_OK (JSON ``{"version", "tenant", "auth", "tiers", "max_ids", "max_block_bytes",
    "max_tokens", "max_json"}``): who the caller is and the node's limits. ``tiers`` names
    the tier indexes of LOOKUP_OK."""

    tenant: str
    auth: bool
    tiers: tuple[str, ...]
    limits: Limits
    version: int = VERSION


def encode_hello_ok(request_id: int, ok: HelloOk) -> bytes:
    return _json_frame(
        Op.HELLO_OK,
        request_id,
        {
            "version": ok.version,
            "tenant": ok.tenant,
            "auth": ok.auth,
            "tiers": list(ok.tiers),
            **ok.limits._asdict(),
        },
    )


def decode_hello_ok(data: bytes) -> HelloOk:
    body = _json_body(data, "HELLO_OK")
    try:
        limits = Limits(**{name: int(body[name]) for name in Limits._fields})
        tiers = tuple(str(t) for t in body["tiers"])
        tenant, auth, version = body["tenant"], body["auth"], int(body["version"])
    except (KeyError, TypeError, ValueError) as exc:
        raise FrameError(f"HELLO_OK: missing or bad field: {exc}") from None
    if not isinstance(tenant, str) or not isinstance(auth, bool):
        raise FrameError("HELLO_OK: bad tenant or auth")
    if version not in VERSIONS:
        raise VersionError(version)
    return HelloOk(tenant, auth, tiers, limits, version)


def encode_resolve(request_id: int, namespace: Namespace) -> bytes:
    """RESOLVE (JSON namespace, as in the REST API): the caller's root of that namespace."""
    return _json_frame(Op.RESOLVE, request_id, namespace.as_json())


def decode_resolve(data: bytes) -> Namespace:
    body = _json_body(data, "RESOLVE")
    unknown = set(body) - set(Namespace.__dataclass_fields__)
    if unknown:
        raise InvalidInput(f"RESOLVE: unknown namespace fields {sorted(unknown)}")
    try:
        return check_client_namespace(Namespace(**body))
    except TypeError as exc:
        raise InvalidInput(f"RESOLVE: not a namespace: {exc}") from None


def encode_resolve_ok(request_id: int, root: bytes) -> bytes:
    """RESOLVE_OK: the 16-byte root."""
    return frame(Op.RESOLVE_OK, request_id, root)


def decode_resolve_ok(data: bytes) -> bytes:
    if len(data) != HASH_BYTES:
        raise FrameError(f"RESOLVE_OK: a root is {HASH_BYTES} bytes, got {len(data)}")
    return bytes(data)


# -- RELEASE and ERROR ---------------------------------------------------------------------


def encode_release(request_id: int, lease: bytes, *, check: bool = False) -> bytes:
    """RELEASE (``lease[16]``); answered by an empty RELEASE_OK. With ``check``
    (``F_RELEASE_CHECK``) the answer's ``F_RELEASE_LIVE`` says whether the lease was still
    live, and a lease that is over is no error."""
    if len(lease) != HASH_BYTES:
        raise InvalidInput(f"a lease id is {HASH_BYTES} bytes")
    flags = F_RELEASE_CHECK if check else 0
    return frame(Op.RELEASE, request_id, lease, flags)


def decode_release(data: bytes) -> bytes:
    if len(data) != HASH_BYTES:
        raise FrameError(f"RELEASE: the body is a {HASH_BYTES}-byte lease id")
    return bytes(data)


def encode_release_ok(request_id: int, *, live: bool = False) -> bytes:
    return frame(Op.RELEASE_OK, request_id, b"", F_RELEASE_LIVE if live else 0)


_ERROR = struct.Struct("<H")


class ErrorFrame(NamedTuple):
    """ERROR (``code:u16`` + a UTF-8 message): see ``errors.ErrorCode``; with
    ``F_ERROR_CLOSING`` the node closes the connection after it."""

    code: int
    message: str
    closing: bool = False


def encode_error(request_id: int, error: ErrorFrame, *, version: int = FRAME_VERSION) -> bytes:
    """An ERROR frame; ``version``: the peer's, when refusing a peer of another version (an
    ERROR's layout is the same in every version, so its peer can read why)."""
    message = error.message.encode("utf-8", "replace")[:MAX_MESSAGE]
    body = _ERROR.pack(error.code) + message
    flags = F_ERROR_CLOSING if error.closing else 0
    return frame(Op.ERROR, request_id, body, flags, version=version)


def decode_error(data: bytes, flags: int) -> ErrorFrame:
    (code,) = fixed_part(_ERROR, data, "ERROR", "code")
    message = bytes(data[_ERROR.size :]).decode("utf-8", "replace")
    return ErrorFrame(code, message, bool(flags & F_ERROR_CLOSING))
