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
"""

from __future__ import annotations

import asyncio
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import TypeVar

from sessioncache.connector.errors import RateLimited, TransportError, Unavailable

T = TypeVar("T")

__all__ = [
    "Backoff",
    "ConstantBackoff",
    "ExponentialBackoff",
    "ExponentialWithJitterBackoff",
    "NoBackoff",
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
