"""The client package: everything an engine needs to talk to a node, and nothing of the node.

``SessionCacheClient`` (blocking) and ``AsyncSessionCacheClient`` (asyncio) are the REST API v1
clients and mirror each other; ``StreamClient`` (the binary block stream) and
``SameHostClient`` (shared memory on the node's host) are the data-plane clients;
``sessioncache.connector.transfer.KVTransfer`` picks the fastest of the three for loads and
stores by tokens or by keys; ``sessioncache.connector.ops`` has the engine side's operations
over a data-plane connection (the one load loop), and ``retry.NodeBackoff`` its one failure
policy. The package imports the core (``sessioncache.errors``,
``hashing``, ``status``) and the wire (``sessioncache.dataplane.frames``), never a server;
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
    NoRoom,
    NotFound,
    PayloadTooLarge,
    ProtocolError,
    RateLimited,
    RemoteError,
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
    NodeBackoff,
    NodeDown,
    Retry,
)
from sessioncache.connector.samehost import SameHostClient, SameHostLookup
from sessioncache.connector.stream import StoreAck, StreamClient, StreamLookup, discover
from sessioncache.hashing import Namespace
from sessioncache.status import BlockStatus

__all__ = [
    "AsyncSessionCacheClient",
    "AuthError",
    "Backoff",
    "BlockNotFound",
    "BlockStatus",
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
    "NoRoom",
    "NodeBackoff",
    "NodeDown",
    "NotFound",
    "PayloadSource",
    "PayloadTooLarge",
    "ProtocolError",
    "RateLimited",
    "RemoteError",
    "Resolved",
    "Retry",
    "SameHostClient",
    "SameHostLookup",
    "ServerError",
    "Session",
    "SessionCacheClient",
    "SessionCacheError",
    "SessionNotFound",
    "StoreAck",
    "StoreResult",
    "StreamClient",
    "StreamLookup",
    "TransportError",
    "Unavailable",
    "UploadRefused",
    "WhoAmI",
    "discover",
]
