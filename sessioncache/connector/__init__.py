"""The engine connector: clients of the sessioncache REST API v1.

``SessionCacheClient`` (blocking) and ``AsyncSessionCacheClient`` (asyncio) mirror each other;
``sessioncache.connector.transformers`` turns a Hugging Face transformers KV cache into block
payloads and back (import it explicitly: it needs torch and transformers, this package does not).
``sessioncache.connector.lmcache`` (LMCache's multiprocess L2 adapter) and
``sessioncache.connector.lmcache_remote`` (its in-process remote storage plugin, which imports
LMCache) are loaded by LMCache itself (``docs/lmcache.md``).
"""

from sessioncache.connector.client import AsyncSessionCacheClient, SessionCacheClient
from sessioncache.connector.errors import (
    AuthError,
    BlockNotFound,
    IdMismatch,
    InvalidRequest,
    LeaseNotFound,
    NotFound,
    PayloadTooLarge,
    ProtocolError,
    RateLimited,
    ServerError,
    SessionCacheError,
    SessionNotFound,
    TransportError,
    Unavailable,
    UploadRefused,
)
from sessioncache.connector.protocol import (
    Lease,
    LookupResult,
    Miss,
    MissTotals,
    PayloadSource,
    Resolved,
    Session,
    StoreResult,
    WhoAmI,
)
from sessioncache.connector.retry import (
    Backoff,
    ConstantBackoff,
    ExponentialBackoff,
    ExponentialWithJitterBackoff,
    NoBackoff,
    Retry,
)
from sessioncache.hashing import Namespace

__all__ = [
    "AsyncSessionCacheClient",
    "AuthError",
    "Backoff",
    "BlockNotFound",
    "ConstantBackoff",
    "ExponentialBackoff",
    "ExponentialWithJitterBackoff",
    "IdMismatch",
    "InvalidRequest",
    "Lease",
    "LeaseNotFound",
    "LookupResult",
    "Miss",
    "MissTotals",
    "Namespace",
    "NoBackoff",
    "NotFound",
    "PayloadSource",
    "PayloadTooLarge",
    "ProtocolError",
    "RateLimited",
    "Resolved",
    "Retry",
    "ServerError",
    "Session",
    "SessionCacheClient",
    "SessionCacheError",
    "SessionNotFound",
    "StoreResult",
    "TransportError",
    "Unavailable",
    "UploadRefused",
    "WhoAmI",
]
