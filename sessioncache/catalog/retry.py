"""Reads (and idempotent writes) of the catalog retried once their connection turns out dead."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from sqlalchemy.exc import DBAPIError

log = logging.getLogger("sessioncache.catalog")

_P = ParamSpec("_P")
_R = TypeVar("_R")
_READ_ATTEMPTS = 3


def retried_on_disconnect(read: Callable[_P, _R]) -> Callable[_P, _R]:
    """``read`` again, on a new connection, when the one it was given turned out dead (its
    backend terminated, a failover) after the pool's pre-ping passed: the pool drops such a
    connection, and a read or an idempotent write (an upsert, a delete) is safe to repeat.
    Any other error is raised at once."""

    @functools.wraps(read)
    def retried(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        for attempt in range(1, _READ_ATTEMPTS + 1):
            try:
                return read(*args, **kwargs)
            except DBAPIError as exc:
                if not exc.connection_invalidated or attempt == _READ_ATTEMPTS:
                    raise
                log.info("catalog connection lost during %s; retrying", read.__name__)
        raise AssertionError("unreachable")

    return retried
