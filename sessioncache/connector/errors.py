"""The connector's exceptions: the classes of ``sessioncache.errors``, under the names the
connector has always exported.

Every error answer becomes the class that ``sessioncache.errors.TABLE`` gives its name and
status (``from_http``), so ``except BlockNotFound`` catches a local store's error and the
service's answer alike. An error raised for an answer carries its ``status``, ``error`` (the
answer's name) and ``detail``; ``ServerError`` is the root they all share::

    SessionCacheError (ServerError)
    ├── TransportError            connection refused/reset, timeout (after retries)
    ├── ProtocolError             a response that is not what the API promises
    ├── IdMismatch                the server's block ids differ from the client's own
    ├── InvalidInput              422 (InvalidRequest; also a ValueError)
    ├── AuthRefused               401 (AuthError)
    ├── Refused                   403: UploadRefused, StoreRefused, ...
    ├── NotFound                  404: BlockNotFound, LeaseNotFound, SessionNotFound (KeyErrors)
    ├── BodyTooLarge              413 (PayloadTooLarge)
    ├── RateLimited               429        retried
    ├── Unavailable               502/503/504 retried
    ├── NoRoom                    507: the node could not keep a block
    └── RemoteError               500 and anything else
"""

from __future__ import annotations

from sessioncache.errors import (
    AuthRefused,
    BlockNotFound,
    BodyTooLarge,
    IdMismatch,
    InvalidInput,
    LeaseNotFound,
    NoRoom,
    NotFound,
    ProtocolError,
    RateLimited,
    RemoteError,
    SessionCacheError,
    SessionNotFound,
    TransportError,
    Unavailable,
    UploadRefused,
)

AuthError = AuthRefused
InvalidRequest = InvalidInput
PayloadTooLarge = BodyTooLarge
ServerError = SessionCacheError

__all__ = [
    "AuthError",
    "BlockNotFound",
    "IdMismatch",
    "InvalidRequest",
    "LeaseNotFound",
    "NoRoom",
    "NotFound",
    "PayloadTooLarge",
    "ProtocolError",
    "RateLimited",
    "RemoteError",
    "ServerError",
    "SessionCacheError",
    "SessionNotFound",
    "TransportError",
    "Unavailable",
    "UploadRefused",
]
