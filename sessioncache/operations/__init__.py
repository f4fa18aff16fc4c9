"""The data operations of a node, one implementation each, under every carrier.

A carrier (the REST API, the binary stream, the same-host socket) decodes a request into one of
the messages of ``messages.py``, calls the operation with the ``Caller`` it speaks for, and
encodes the answer. Everything the product means by an operation happens here, once:

- tenancy screening (a caller reads and extends only chains under roots it resolved);
- sessions (a named session's TTL, pins and head);
- token accounting (``accounting.py``: hit and miss tokens per node, namespace and session);
- miss attribution (``sessioncache.attribution``).

The operations, after vLLM's offloading manager contract:

================  =============================================================
``resolve``       the caller's root of a namespace (``lookups.py``)
``lookup``        the longest held prefix of ids (by tokens, ids or keys), leased on request
``exists``        which ids are held under a root, each on its own
``locate``        a leased lookup answered with where its blocks lie in shared memory
``plan_load``     what a load sends (a lease's blocks, or the held prefix of ids)
``release``       end a lease
``plan_store``    a store's ids, checked against the caller's chain (``stores.py``)
``store_block``   one block of a planned store, written through
``stage``         slots in shared memory for a planned store; ``commit`` and ``abort``
``complete``      what a finished store means for its session
``open_session``  open a session of the caller's (``sessions.py``); ``get_session``,
                  ``extend_session``, ``finish_session``, ``close_session``
================  =============================================================
"""

from sessioncache.operations.caller import Caller, CallerLease
from sessioncache.operations.messages import LookupRequest, LookupResult, StoreRequest

__all__ = ["Caller", "CallerLease", "LookupRequest", "LookupResult", "StoreRequest"]
