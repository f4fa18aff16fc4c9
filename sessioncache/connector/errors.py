"""The connector's exceptions, all rooted in ``sessioncache.errors.SessionCacheError``.

Every error answer of the server (``{"error": ..., "detail": ...}``) becomes a ``ServerError``
subclass chosen by its HTTP status and error name. Where the core library has a class for the
same condition the client's class also derives from it, so ``except BlockNotFound`` (from
``sessioncache.errors``) catches both a local store's error and the service's answer::

    SessionCacheError
    ├── TransportError            connection refused/reset, timeout (after retries)
    ├── ProtocolError             a response that is not what the API promises
    ├── IdMismatch                the server's block ids differ from the client's own
    └── ServerError               any error status; .status .error .detail
        ├── InvalidRequest        422 (also an InvalidInput / ValueError)
        ├── AuthError             401
        ├── UploadRefused         403
        ├── NotFound              404
        │   ├── BlockNotFound     (also sessioncache.errors.BlockNotFound)
        │   ├── LeaseNotFound     (also sessioncache.errors.LeaseNotFound)
        │   └── SessionNotFound   (also a KeyError)
        ├── PayloadTooLarge       413
        ├── RateLimited           429        retried
        └── Unavailable           502/503/504 retried
"""

from __future__ import annotations

from sessioncache import errors as core
from sessioncache.errors import SessionCacheError

__all__ = [
    "AuthError",
    "BlockNotFound",
    "IdMismatch",
    "InvalidRequest",
    "LeaseNotFound",
    "NotFound",
    "PayloadTooLarge",
    "ProtocolError",
    "RateLimited",
    "ServerError",
    "SessionCacheError",
    "SessionNotFound",
    "TransportError",
    "Unavailable",
    "UploadRefused",
]


class TransportError(SessionCacheError):
    """The request never got an answer: connection refused or reset, or a timeout."""


class ProtocolError(SessionCacheError):
    """The server answered something the v1 API does not define (bad JSON, bad framing)."""


class IdMismatch(SessionCacheError):
    """The server's block ids are not the ones the client derived itself: the two disagree on
    the hash seed, the namespace or the tenant salt, and reusing the KV would be wrong."""


class ServerError(SessionCacheError):
    """An error status from the server, with its JSON ``error`` name and ``detail``."""

    retry_after: float | None = None
    """Seconds from a ``Retry-After`` header, when the server sent one."""

    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(f"{status} {error}: {detail}")
        self.status = status
        self.error = error
        self.detail = detail

    def __str__(self) -> str:  # KeyError subclasses would quote the message
        return f"{self.status} {self.error}: {self.detail}"

    def __reduce__(self) -> tuple[type[ServerError], tuple[int, str, str]]:
        return (type(self), (self.status, self.error, self.detail))


class InvalidRequest(ServerError, core.InvalidInput):
    """422: the server refused the request as malformed."""


class AuthError(ServerError):
    """401: no API key, or one the server does not know."""


class UploadRefused(ServerError):
    """403: a block upload that ``POST /v1/store`` did not hand out (or whose slot expired)."""


class NotFound(ServerError):
    """404."""


class BlockNotFound(NotFound, core.BlockNotFound):
    """404: the block is not held (or not for this tenant)."""


class LeaseNotFound(NotFound, core.LeaseNotFound):
    """404: the lease is unknown, expired or already released."""


class SessionNotFound(NotFound, KeyError):
    """404: no open session with that id for this tenant."""


class PayloadTooLarge(ServerError):
    """413: a body beyond the server's limit."""


class RateLimited(ServerError):
    """429: the server asks to slow down (retried)."""


class Unavailable(ServerError):
    """502, 503 or 504: the server or a proxy in front of it cannot serve now (retried)."""


_BY_NAME: dict[str, type[ServerError]] = {
    "BlockNotFound": BlockNotFound,
    "LeaseNotFound": LeaseNotFound,
    "SessionNotFound": SessionNotFound,
}
_BY_STATUS: dict[int, type[ServerError]] = {
    401: AuthError,
    403: UploadRefused,
    404: NotFound,
    413: PayloadTooLarge,
    422: InvalidRequest,
    429: RateLimited,
    502: Unavailable,
    503: Unavailable,
    504: Unavailable,
}


def error_for(status: int, error: str, detail: str) -> ServerError:
    """The exception for one error answer (by error name first, then by status)."""
    cls = _BY_NAME.get(error) if status == 404 else None
    if cls is None:
        cls = _BY_STATUS.get(status, ServerError)
    return cls(status, error, detail)
