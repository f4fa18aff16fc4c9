"""A store on behalf of a session for tests of a bare ``SessionManager`` (no node, no carrier):
what the operation layer does for a STORE (``operations.stores``): the store's put with the
session's TTL and forecast, then the session records the chain."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sessioncache.hashing import BlockHash
from sessioncache.sessions.manager import DEFAULT_TENANT, SessionManager
from sessioncache.store import WriteResult
from sessioncache.store.forecast import finish_class
from sessioncache.tiers.payload import Payload


def put_in_session(
    sessions: SessionManager,
    session_id: str,
    hashes: Sequence[BlockHash],
    payloads: Sequence[Payload],
    *,
    namespace_root: bytes,
    prefix: Sequence[BlockHash] = (),
    tenant: str = DEFAULT_TENANT,
    durable: bool = False,
    finish_reason: str | None = None,
) -> WriteResult:
    """Store ``hashes`` (whose parent is ``prefix[-1]``) for the session; its chain becomes
    ``prefix + hashes``."""
    session = sessions.get(session_id, tenant=tenant)
    finish = finish_class(finish_reason) if finish_reason is not None else None
    result = sessions.store.writes.put(
        hashes,
        payloads,
        namespace_root=namespace_root,
        parent=prefix[-1] if prefix else None,
        ttl_s=session.ttl_s,
        durable=durable,
        next_use=sessions.forecasts.next_use(session.key, finish),
    )
    sessions.record(session_id, [*prefix, *hashes], tenant=tenant, finish_reason=finish_reason)
    return result


def session_turn(
    sessions: SessionManager,
    session_id: str,
    hashes: Sequence[BlockHash],
    payload: Callable[[BlockHash], Payload],
    *,
    namespace_root: bytes,
    tenant: str = DEFAULT_TENANT,
    finish_reason: str | None = None,
) -> None:
    """One request of the session: a lookup of ``hashes``, then a store of what missed
    (``payload`` of each id), finishing for ``finish_reason`` when given."""
    match = sessions.lookup(session_id, hashes, tenant=tenant)
    new = hashes[match.num_blocks :]
    put_in_session(
        sessions,
        session_id,
        new,
        [payload(h) for h in new],
        namespace_root=namespace_root,
        prefix=match.hashes,
        tenant=tenant,
        finish_reason=finish_reason,
    )
