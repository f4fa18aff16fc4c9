"""Retries with backoff, as small strategy objects (in the manner of redis-py)::

    Retry(ExponentialBackoff(base=0.05, cap=2.0), attempts=3)

A ``Backoff`` maps the number of failures so far to a delay in seconds; a ``Retry`` decides
whether an error is worth another attempt and runs a call (sync or async) until it succeeds or
the attempts are spent, re-raising the last error. Only *transient* errors are retried:
transport failures (connection refused/reset, timeouts), 429 and 502/503/504. A 4xx answer is
the caller's mistake and is raised at once.

Retried requests must be safe to repeat. Every connector request is: ``POST /v1/store`` only
re-plans, ``PUT /v1/blocks/{id}`` answers ``stored=false`` for a block already held, and a
lookup repeated after a lost answer at worst takes a second lease that expires by itself.

The engine side's adapters (``KVTransfer``'s users: vLLM's ``EngineNode``, SGLang, LMCache)
retry nothing: an engine recomputes what it cannot load. Their one failure policy is
``NodeBackoff``: an error the node answered about one request (bad input, a refused key or
session, a tenant's bound, a lease lost: ``REQUEST_ERRORS``) makes that request miss and
leaves the node up; anything else (a transport error, a broken or silent connection) is the
node's: the adapter's connection is closed, and for a backoff that doubles with each failure
in a row (``BACKOFF_S`` up to ``MAX_BACKOFF_S``) calls answer at once without touching the
network (``NodeDown``: a miss, a store not made); the first call after it connects again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import TypeVar

from sessioncache.connector.errors import RateLimited, TransportError, Unavailable
from sessioncache.errors import (
    AuthRefused,
    IdMismatch,
    InvalidInput,
    NotFound,
    QuotaExceeded,
    Refused,
    SessionCacheError,
)

T = TypeVar("T")
log = logging.getLogger("sessioncache.connector.retry")

__all__ = [
    "Backoff",
    "ConstantBackoff",
    "ExponentialBackoff",
    "ExponentialWithJitterBackoff",
    "NoBackoff",
    "NodeBackoff",
    "NodeDown",
    "Retry",
]


class Backoff(ABC):
    """How long to wait before the next attempt, given how many attempts failed so far."""

    @abstractmethod
    def compute(self, failures: int) -> float:
        """The delay in seconds after ``failures`` (>= 1) failed attempts."""

    def reset(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Called before each retried operation starts; stateful backoffs reset here."""


class NoBackoff(Backoff):
    """Retry at once."""

    def compute(self, failures: int) -> float:
        return 0.0


class ConstantBackoff(Backoff):
    """Always the same delay."""

    def __init__(self, delay: float) -> None:
        if delay < 0:
            raise ValueError("delay must be >= 0")
        self.delay = delay

    def compute(self, failures: int) -> float:
        return self.delay


class ExponentialBackoff(Backoff):
    """``min(cap, base * 2 ** (failures - 1))``: 50 ms, 100 ms, 200 ms, ... by default."""

    def __init__(self, base: float = 0.05, cap: float = 2.0) -> None:
        if base < 0 or cap < 0:
            raise ValueError("base and cap must be >= 0")
        self.base = base
        self.cap = cap

    def compute(self, failures: int) -> float:
        return min(self.cap, self.base * 2.0 ** max(0, failures - 1))


class ExponentialWithJitterBackoff(ExponentialBackoff):
    """Full jitter: uniform in ``[0, ExponentialBackoff.compute(failures)]``, so that many
    clients retrying against one recovering server do not arrive in lockstep."""

    def __init__(
        self, base: float = 0.05, cap: float = 2.0, rng: random.Random | None = None
    ) -> None:
        super().__init__(base, cap)
        self._rng = rng or random.Random()

    def compute(self, failures: int) -> float:
        return self._rng.uniform(0.0, super().compute(failures))


RETRYABLE: tuple[type[Exception], ...] = (TransportError, RateLimited, Unavailable)
"""The errors ``Retry`` retries by default: transport failures, 429 and 502/503/504."""


class Retry:
    """Up to ``attempts`` tries in all (1 means no retry), waiting ``backoff`` in between.

    ``retry_on`` lists the exception classes that are retried; for a ``RateLimited`` or
    ``Unavailable`` answer that carries ``Retry-After`` the wait is at least that (bounded by
    ``max_retry_after``).
    """

    def __init__(
        self,
        backoff: Backoff | None = None,
        attempts: int = 3,
        *,
        retry_on: tuple[type[Exception], ...] = RETRYABLE,
        max_retry_after: float = 30.0,
    ) -> None:
        if attempts < 1:
            raise ValueError("attempts must be >= 1")
        self.backoff = backoff if backoff is not None else ExponentialWithJitterBackoff()
        self.attempts = attempts
        self.retry_on = retry_on
        self.max_retry_after = max_retry_after

    def __repr__(self) -> str:
        return f"Retry({type(self.backoff).__name__}, attempts={self.attempts})"

    def delay_after(self, error: Exception, failures: int) -> float | None:
        """The wait before the next attempt after ``failures`` failed ones ending in ``error``,
        or None when ``error`` is to be raised (not retryable, or the attempts are spent)."""
        if not isinstance(error, self.retry_on) or failures >= self.attempts:
            return None
        delay = self.backoff.compute(failures)
        retry_after = getattr(error, "retry_after", None)
        if isinstance(retry_after, int | float) and retry_after > 0:
            delay = max(delay, min(float(retry_after), self.max_retry_after))
        return delay

    def call(self, fn: Callable[[], T], *, sleep: Callable[[float], None] = time.sleep) -> T:
        """``fn()`` with retries."""
        self.backoff.reset()
        failures = 0
        while True:
            try:
                return fn()
            except Exception as exc:
                failures += 1
                delay = self.delay_after(exc, failures)
                if delay is None:
                    raise
            sleep(delay)

    async def acall(
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> T:
        """``await fn()`` with retries (the async mirror of ``call``)."""
        self.backoff.reset()
        failures = 0
        while True:
            try:
                return await fn()
            except Exception as exc:
                failures += 1
                delay = self.delay_after(exc, failures)
                if delay is None:
                    raise
            await sleep(delay)


# -- the engine side's failure policy ---------------------------------------------------


REQUEST_ERRORS: tuple[type[Exception], ...] = (
    InvalidInput,
    AuthRefused,
    Refused,
    NotFound,
    QuotaExceeded,
    RateLimited,
    IdMismatch,
)
"""What a node answers about one request: that request misses; the node stays up."""
BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


class NodeDown(SessionCacheError):
    """The node failed a moment ago: within its backoff, a call answers at once, without
    touching the network."""


class NodeBackoff:
    """The engine side's failure policy (module docstring), shared by an adapter's
    threads: ``failure`` classifies an error, and after one of the node's the node is
    ``down`` for a backoff that doubles with each failure in a row (``base`` seconds up to
    ``cap``), so that a node that is dead or silent costs one timeout per backoff, not one
    per call; ``ok`` after a call that succeeded ends the run of failures."""

    def __init__(
        self,
        *,
        base: float = BACKOFF_S,
        cap: float = MAX_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._delays = ExponentialBackoff(base, max(base, cap))
        self._clock = clock
        self._failures = 0
        self._retry_at = 0.0
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        """Within the backoff after a failure of the node: calls skip it."""
        return self._clock() < self._retry_at

    @property
    def retry_in(self) -> float:
        """Seconds until the backoff ends (0 when the node is not down)."""
        return max(0.0, self._retry_at - self._clock())

    def failed(self) -> float:
        """A call failed for the node's fault: back off; the backoff's seconds."""
        with self._lock:
            self._failures += 1
            delay = self._delays.compute(self._failures)
            self._retry_at = self._clock() + delay
        return delay

    def ok(self) -> None:
        self._failures = 0

    def failure(
        self, exc: BaseException, disconnect: Callable[[], None] | None = None
    ) -> float | None:
        """A call raised ``exc``: a refusal of the request itself (``REQUEST_ERRORS``) leaves
        the node up (None); anything else is the node's or the carrier's: ``disconnect``
        (the next call after the backoff connects again) and back off (its seconds)."""
        if isinstance(exc, REQUEST_ERRORS):
            return None
        if disconnect is not None:
            with contextlib.suppress(Exception):
                disconnect()
        return self.failed()

    def guard(self, op: Callable[[], T], disconnect: Callable[[], None] | None = None) -> T:
        """``op()`` unless the node is down (``NodeDown``, at once); an exception it raises is
        classified (``failure``) and raised again; a success ends the run of failures."""
        if self.down:
            raise NodeDown(f"the node failed: next try in {self.retry_in:.1f} s")
        try:
            result = op()
        except Exception as exc:
            self.failure(exc, disconnect)
            raise
        self.ok()
        return result

    def call(
        self,
        what: str,
        op: Callable[[], T],
        missed: T,
        disconnect: Callable[[], None] | None = None,
    ) -> T:
        """``guard(op)`` for an adapter whose contract is to miss, never to raise: ``missed``
        when the node is down or the call failed (said in a warning, a node's failure once
        per backoff)."""
        try:
            return self.guard(op, disconnect)
        except NodeDown:
            return missed
        except Exception as exc:
            if isinstance(exc, REQUEST_ERRORS):
                log.warning("sessioncache %s refused: %s", what, exc)
            else:
                log.warning(
                    "sessioncache %s failed (retry in %.0f s): %s", what, self.retry_in, exc
                )
            return missed
