"""Wrong secrets per source address (``Lockout``): one address's guesses mark that address
only, and a bounded table of addresses holds them.

An address past ``max_failures`` wrong secrets within ``window_s`` is *locked*: its wrong
secrets are answered 429 until the window has passed. The lockout never refuses a right
secret (the callers compare first): a guesser behind the admin's own address, a proxy's or a
NAT's, cannot lock the admin out.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

MAX_FAILURES = 30
"""Wrong secrets per ``FAILURE_WINDOW_S`` after which an address is locked."""
FAILURE_WINDOW_S = 60.0
MAX_ADDRESSES = 4096
"""Addresses remembered at once; past it the one whose last failure is oldest is forgotten."""


class Lockout:
    """The recent wrong secrets of each source address (module docstring)."""

    def __init__(
        self,
        *,
        max_failures: int = MAX_FAILURES,
        window_s: float = FAILURE_WINDOW_S,
        max_addresses: int = MAX_ADDRESSES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self._max_addresses = max_addresses
        self._clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def failed(self, address: str) -> None:
        """Count one wrong secret from ``address``."""
        now = self._clock()
        with self._lock:
            times = self._failures.pop(address, None)
            if times is None:
                times = deque(maxlen=self.max_failures)
            times.append(now)
            self._failures[address] = times  # the most recent last
            while len(self._failures) > self._max_addresses:
                self._failures.popitem(last=False)

    def locked(self, address: str) -> bool:
        """``max_failures`` wrong secrets came from ``address`` within the window."""
        now = self._clock()
        with self._lock:
            times = self._failures.get(address)
            if times is None:
                return False
            if times[-1] <= now - self.window_s:
                del self._failures[address]
                return False
            return len(times) == self.max_failures and times[0] > now - self.window_s
