"""Every error sessioncache raises on purpose, and the one table that carries them across a wire.

Each class is a ``SessionCacheError``. ``TABLE`` gives each class that crosses a wire its HTTP
status and its block-stream code; the REST API, the stream and same-host servers, and every
client translate with the four functions below and nowhere else:

- ``http_status(exc)`` and ``stream_code(exc)``: what a server answers for an exception (the
  most specific class of the table that it is; 500 / ``INTERNAL`` for anything else);
- ``from_http(status, name, detail)`` and ``from_stream(code, message)``: the exception a
  client raises for an answer: the class the answer names (REST bodies carry the class name),
  else the first row of the table with that status or code.

A client's exception carries the answer it came from: ``status`` (the HTTP status) or
``code`` (the stream's), and ``detail``; they are None on an error raised locally::

    code  HTTP  class                raised when
       1   500  RemoteError          the node failed in an unexpected way (its log has why)
       2   400  FrameError           a frame that breaks the framing; the connection closes
       3   401  AuthRefused          no or an unknown key, or a peer refused without keys
       4   422  InvalidInput         a well-formed request with bad values
       5   422  PayloadSizeError     a payload of the wrong size for its namespace or slot
       6   404  BlockNotFound
       7   404  LeaseNotFound        unknown on this connection, released, or expired
       8   403  StoreRefused         a store under a root or parent not the caller's
       -   403  UploadRefused        a REST upload of an id not handed out to the caller
       9   503  Busy                 the node serves its maximum of connections
      10   507  DurableStoreFailed   a durable store the durable tier could not take
      11   404  SessionNotFound      a session named in a request is not open
      12   507  NoRoom               a block no tier could make room for
      13   429  QuotaExceeded        the caller's tenant is at one of its bounds
       -   404  NotFound             (any other 404), EngineNotFound
       -   409  EngineExists
       -   408  RequestTimeout       a REST request body slower than the node's least rate
       -   413  BodyTooLarge
       -   429  RateLimited
       -   503  Unavailable          (also 502 and 504)
       -   503  CatalogUnavailable   the catalog's database is down, locked or read-only
       -   401  AdminAuthRequired;  403 AdminRequired, AdminForbidden
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class SessionCacheError(Exception):
    """Root of every error raised on purpose by sessioncache."""

    status: int | None = None
    """The HTTP status of the answer this error was raised for (None: raised locally)."""
    code: ErrorCode | None = None
    """The block-stream code of the answer this error was raised for (None: raised locally)."""
    retry_after: float | None = None
    """Seconds from a ``Retry-After`` header, when the server sent one; on the node, when to
    ask again (answered as ``Retry-After``)."""

    @property
    def detail(self) -> str:
        """The message (the server's, for an error answered by one)."""
        return str(self.args[0]) if self.args else ""

    @property
    def error(self) -> str:
        """The error's name, as REST bodies carry it."""
        return type(self).__name__


# -- the caller's request -------------------------------------------------------------------


class InvalidInput(SessionCacheError, ValueError):
    """The caller passed something malformed (bad token ids, negative TTL, bad id, ...)."""


class PayloadSizeError(InvalidInput):
    """A payload's length does not match the size its namespace or slot requires."""


class UnknownTier(InvalidInput, KeyError):
    """A tier name that the store does not have."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown tier"


class FrameError(InvalidInput):
    """A frame that breaks the framing (bad magic or version, unknown opcode, a length over
    the limits or not matching its body, a body cut short); the connection is closed."""


class EventDecodeError(InvalidInput):
    """A payload or message that is not a vLLM KV event batch."""


class BodyTooLarge(SessionCacheError):
    """A request body beyond the configured limit."""


# -- who may do it --------------------------------------------------------------------------


class AuthRefused(SessionCacheError):
    """No or an unknown API key (HTTP, or the stream's HELLO), no HELLO first, or a peer that
    is not on this host while the node runs without API keys."""


class AdminAuthRequired(AuthRefused):
    """No or a wrong admin token (cookie or bearer) on an ``/admin`` request."""


class Refused(SessionCacheError):
    """The node refuses this caller this thing, whoever the caller is."""


class StoreRefused(Refused):
    """A store under a namespace root not resolved on this connection, or hanging off a
    parent that is not held under that root (nobody plants blocks in a chain not their own)."""


class UploadRefused(Refused):
    """A payload for an id that was not handed out to this caller (or whose slot expired)."""


class AdminRequired(Refused):
    """A tenant's key on an operation that needs the admin token."""


class AdminForbidden(Refused):
    """An ``/admin`` request refused whatever it carries: a mutation without its CSRF token,
    or the dashboard disabled (no admin token and not the local-only open mode)."""


# -- what it names --------------------------------------------------------------------------


class NotFound(SessionCacheError, KeyError):
    """The thing named is not there (or not for this tenant)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else type(self).__name__


class BlockNotFound(NotFound):
    """The block is not in the cache (never stored, expired or evicted)."""


class LeaseNotFound(NotFound):
    """The lease id is unknown or the lease has already expired or been released."""


class LeaseLost(LeaseNotFound):
    """The lease ran out before a same-host copy ended: the slots may have been reused
    meanwhile, so what was copied may be torn. Discard it and look up again."""


class SessionNotFound(NotFound):
    """No open session with that id (for that tenant)."""


class EngineNotFound(NotFound):
    """No engine of that id is registered (or the caller's tenant may not see it)."""


class EngineExists(SessionCacheError):
    """An engine of that id, or one of another tenant at that endpoint, is already
    registered."""


# -- room -----------------------------------------------------------------------------------


class TierFull(SessionCacheError):
    """A tier has no room for a payload; the store catches this and evicts or demotes."""


class TierUnavailable(TierFull):
    """Redis (the shared tier, the fleet index) cannot be reached right now. A ``TierFull``
    (so the store moves on to the next tier, or drops the demotion)."""


class NoRoom(SessionCacheError):
    """A block the node could not keep: no tier could make room for it (everything there is
    pinned, or the policy keeps what it holds). Nothing was stored; a later store may fit."""


class DurableStoreFailed(NoRoom):
    """A durable store whose block could not be written to the durable tier (its filesystem
    full, or nothing there evictable): the caller must not take the block as durable."""


# -- the node and the way there -------------------------------------------------------------


class CorruptBlock(SessionCacheError):
    """A stored payload failed its checksum or was truncated; it is quarantined, never served."""


class ChecksumMismatch(SessionCacheError):
    """A block copied out of shared memory does not match the XXH3-64 the node gave for it."""


class CatalogError(SessionCacheError):
    """The catalog cannot be used as asked (closed, not migrated, unsupported database)."""


class CatalogNotMigrated(CatalogError):
    """The database is not at the newest schema revision: run ``sessioncache db upgrade``."""


class RemoteError(SessionCacheError):
    """The node failed in an unexpected way (its log has the details)."""


class Unavailable(SessionCacheError):
    """The node, or a proxy in front of it, cannot serve now (retried by the REST client)."""


class CatalogUnavailable(Unavailable):
    """The catalog cannot be used now (its database down, locked or read-only): answered 503
    with ``Retry-After``; blocks are still served and stored."""


class Busy(Unavailable):
    """The node already serves its maximum number of connections."""


class RequestTimeout(SessionCacheError):
    """A REST request's body did not arrive in time; its connection was closed."""


class RateLimited(SessionCacheError):
    """The node asks to slow down (retried by the REST client)."""


class QuotaExceeded(SessionCacheError):
    """The caller's tenant is at one of its bounds (engines, bytes in flight, ...): the
    request is refused until the tenant holds less."""


class TransportError(SessionCacheError):
    """The request never got an answer: connection refused or reset, or a timeout."""


class StreamClosed(SessionCacheError):
    """A data-plane connection is gone: closed by either end, reset, or timed out."""


class ProtocolError(SessionCacheError):
    """The server answered something its protocol does not define (bad JSON, bad framing)."""


class IdMismatch(SessionCacheError):
    """The server's block ids are not the ones the client derived itself: the two disagree on
    the hash seed, the namespace or the tenant salt, and reusing the KV would be wrong."""


# -- the table ------------------------------------------------------------------------------


class ErrorCode(IntEnum):
    """The block stream's error codes (the ``u16`` of an ``ERROR`` frame)."""

    INTERNAL = 1
    MALFORMED = 2
    AUTH = 3
    INVALID = 4
    PAYLOAD_SIZE = 5
    BLOCK_NOT_FOUND = 6
    LEASE_NOT_FOUND = 7
    REFUSED = 8
    BUSY = 9
    STORAGE_FULL = 10
    SESSION_NOT_FOUND = 11
    NO_ROOM = 12
    QUOTA = 13


@dataclass(frozen=True, slots=True)
class Row:
    cls: type[SessionCacheError]
    http: int
    code: ErrorCode | None
    """None: an error that no block-stream answer carries."""


_C = ErrorCode
TABLE: tuple[Row, ...] = (
    Row(RemoteError, 500, _C.INTERNAL),
    Row(FrameError, 400, _C.MALFORMED),
    Row(AuthRefused, 401, _C.AUTH),
    Row(AdminAuthRequired, 401, None),
    Row(InvalidInput, 422, _C.INVALID),
    Row(PayloadSizeError, 422, _C.PAYLOAD_SIZE),
    Row(NotFound, 404, None),
    Row(BlockNotFound, 404, _C.BLOCK_NOT_FOUND),
    Row(LeaseNotFound, 404, _C.LEASE_NOT_FOUND),
    Row(SessionNotFound, 404, _C.SESSION_NOT_FOUND),
    Row(EngineNotFound, 404, None),
    Row(Refused, 403, None),
    Row(StoreRefused, 403, _C.REFUSED),
    Row(UploadRefused, 403, None),
    Row(AdminRequired, 403, None),
    Row(AdminForbidden, 403, None),
    Row(EngineExists, 409, None),
    Row(RequestTimeout, 408, None),
    Row(BodyTooLarge, 413, None),
    Row(RateLimited, 429, None),
    Row(QuotaExceeded, 429, _C.QUOTA),
    Row(Unavailable, 503, None),
    Row(Busy, 503, _C.BUSY),
    Row(CatalogUnavailable, 503, None),
    Row(NoRoom, 507, _C.NO_ROOM),
    Row(DurableStoreFailed, 507, _C.STORAGE_FULL),
)
"""Decoding takes the first row with the answer's status or code; encoding the row of the
most specific class an exception is."""

# Most derived first, for encoding: a PayloadSizeError is an InvalidInput too.
_BY_DEPTH = sorted(TABLE, key=lambda row: -len(row.cls.__mro__))
_BY_NAME = {row.cls.__name__: row.cls for row in TABLE}
_BY_STATUS: dict[int, type[SessionCacheError]] = {}
_BY_CODE: dict[int, type[SessionCacheError]] = {}
for _row in TABLE:
    _BY_STATUS.setdefault(_row.http, _row.cls)
    if _row.code is not None:
        _BY_CODE.setdefault(_row.code, _row.cls)
_BY_STATUS.update({502: Unavailable, 504: Unavailable})


def http_status(exc: BaseException | type[BaseException]) -> int:
    """The HTTP status an exception (or its class) is answered with (500 for the rest)."""
    cls = exc if isinstance(exc, type) else type(exc)
    for row in _BY_DEPTH:
        if issubclass(cls, row.cls):
            return row.http
    return 500


def stream_code(exc: BaseException) -> ErrorCode:
    """The block-stream code an exception is answered with (``INTERNAL`` for the rest)."""
    for row in _BY_DEPTH:
        if row.code is not None and isinstance(exc, row.cls):
            return row.code
    return ErrorCode.INTERNAL


def from_http(status: int, name: str, detail: str) -> SessionCacheError:
    """The exception for an HTTP error answer: the class its body names when that class has
    this status, else the first of the table with the status (``RemoteError`` for others)."""
    cls = _BY_NAME.get(name)
    if cls is None or http_status(cls) != status:
        cls = _BY_STATUS.get(status, RemoteError)
    exc = cls(detail)
    exc.status = status
    return exc


def from_stream(code: int, message: str) -> SessionCacheError:
    """The exception for a block-stream ``ERROR`` frame (an unknown code: ``RemoteError``)."""
    cls = _BY_CODE.get(code)
    exc = cls(message) if cls is not None else RemoteError(f"error code {code}: {message}")
    exc.code = ErrorCode(code) if code in ErrorCode._value2member_map_ else None
    return exc
