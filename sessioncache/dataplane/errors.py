"""The data plane's error codes and the exceptions they stand for, on both ends.

An ``ERROR`` frame carries a ``u16`` code and a message. The node chooses the code from the
exception class (``code_for``); the client raises the class the code names (``error_for``),
so a ``BlockNotFound`` on the node is a ``sessioncache.errors.BlockNotFound`` in the client::

    code  name             client raises
       1  INTERNAL         RemoteError          anything unexpected (logged on the node)
       2  MALFORMED        FrameError           a frame the node cannot parse; it closes
       3  AUTH             AuthRefused          no HELLO first, a wrong key, a refused peer
       4  INVALID          InvalidInput         a well-formed request with bad values
       5  PAYLOAD_SIZE     PayloadSizeError     a payload of the wrong size for its namespace
       6  BLOCK_NOT_FOUND  BlockNotFound
       7  LEASE_NOT_FOUND  LeaseNotFound        unknown on this connection, released, expired
       8  REFUSED          StoreRefused         a store under a root or parent not the caller's
       9  BUSY             Busy                 the node serves its maximum of connections
      10  STORAGE_FULL     DurableStoreFailed   a durable store the durable tier could not take
      11  SESSION_NOT_FOUND SessionNotFound     a session named in a request is not open

No import here needs torch: the client side stays light.
"""

from __future__ import annotations

from enum import IntEnum

from sessioncache.errors import (
    AuthRefused as AuthRefused,
)
from sessioncache.errors import (
    BlockNotFound,
    DurableStoreFailed,
    InvalidInput,
    LeaseNotFound,
    PayloadSizeError,
    SessionCacheError,
    SessionNotFound,
    UploadRefused,
)
from sessioncache.errors import (
    StoreRefused as StoreRefused,
)


class FrameError(InvalidInput):
    """A frame that breaks the framing (bad magic or version, unknown opcode, a length over
    the limits or not matching its body, a body cut short); the connection is closed."""


class Busy(SessionCacheError):
    """The node already serves its maximum number of data-plane connections."""


class RemoteError(SessionCacheError):
    """The node failed in an unexpected way (its log has the details)."""


class StreamClosed(SessionCacheError):
    """The connection is gone: closed by either end, reset, or timed out."""


class ErrorCode(IntEnum):
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


_CLASSES: dict[ErrorCode, type[SessionCacheError]] = {
    ErrorCode.INTERNAL: RemoteError,
    ErrorCode.MALFORMED: FrameError,
    ErrorCode.AUTH: AuthRefused,
    ErrorCode.INVALID: InvalidInput,
    ErrorCode.PAYLOAD_SIZE: PayloadSizeError,
    ErrorCode.BLOCK_NOT_FOUND: BlockNotFound,
    ErrorCode.LEASE_NOT_FOUND: LeaseNotFound,
    ErrorCode.REFUSED: StoreRefused,
    ErrorCode.BUSY: Busy,
    ErrorCode.STORAGE_FULL: DurableStoreFailed,
    ErrorCode.SESSION_NOT_FOUND: SessionNotFound,
}

# Most specific first: PayloadSizeError and FrameError are InvalidInputs too.
_ORDER: list[tuple[type[BaseException], ErrorCode]] = [
    (FrameError, ErrorCode.MALFORMED),
    (PayloadSizeError, ErrorCode.PAYLOAD_SIZE),
    (InvalidInput, ErrorCode.INVALID),
    (AuthRefused, ErrorCode.AUTH),
    (BlockNotFound, ErrorCode.BLOCK_NOT_FOUND),
    (LeaseNotFound, ErrorCode.LEASE_NOT_FOUND),
    (StoreRefused, ErrorCode.REFUSED),
    (UploadRefused, ErrorCode.REFUSED),
    (Busy, ErrorCode.BUSY),
    (DurableStoreFailed, ErrorCode.STORAGE_FULL),
    (SessionNotFound, ErrorCode.SESSION_NOT_FOUND),
]


def code_for(exc: BaseException) -> ErrorCode:
    """The code an exception is reported with (``INTERNAL`` for anything unexpected)."""
    for cls, code in _ORDER:
        if isinstance(exc, cls):
            return code
    return ErrorCode.INTERNAL


def error_for(code: int, message: str) -> SessionCacheError:
    """The exception a client raises for an ``ERROR`` frame (unknown codes: ``RemoteError``)."""
    try:
        cls = _CLASSES[ErrorCode(code)]
    except ValueError:
        return RemoteError(f"error code {code}: {message}")
    return cls(message)
