"""The data plane: block payloads between engines and a node over a persistent binary
stream, beside the REST control plane (``docs/dataplane.md``).

``frames`` is the wire format (no I/O), ``transport`` the seam a carrier implements (TCP and
Unix-domain sockets here), ``ops`` the operations over a ``CacheNode``, ``server`` the node's
threaded server, ``client`` the engine's ``StreamClient``. Importing this package loads
neither the server nor torch.
"""

from sessioncache.dataplane.client import StoreAck, StreamClient, StreamLookup, discover
from sessioncache.dataplane.errors import (
    AuthRefused,
    Busy,
    FrameError,
    RemoteError,
    StoreRefused,
    StreamClosed,
)

__all__ = [
    "AuthRefused",
    "Busy",
    "FrameError",
    "RemoteError",
    "StoreAck",
    "StoreRefused",
    "StreamClient",
    "StreamClosed",
    "StreamLookup",
    "discover",
]
