"""One small daemon-thread loop for the node's periodic work (the sweep, the catalog's
write-behind flush, the shared tier's expiry refresh, the fleet index's heartbeat).

``BackgroundLoop(name, step, interval_s)`` calls ``step()`` every ``interval_s`` seconds once
started; ``wake()`` runs the next step now; ``stop()`` ends the loop and joins the thread. A
step that raises is logged and, with ``max_backoff_s``, retried after a doubling delay; an
``Unavailable`` error (a dependency down, which reports itself) is not logged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sessioncache.errors import Unavailable

log = logging.getLogger("sessioncache.background")


class BackgroundLoop:
    """A daemon thread running ``step`` periodically (see the module docstring)."""

    def __init__(
        self,
        name: str,
        step: Callable[[], object],
        interval_s: float,
        *,
        max_backoff_s: float | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self._name = name
        self._step = step
        self._interval = interval_s
        self._max_backoff = max_backoff_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Start the thread (idempotent; a stopped loop starts again)."""
        with self._lock:
            if self._thread is not None:
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """Run the next step now instead of at the end of the period."""
        self._wake.set()

    def stop(self, timeout_s: float | None = 10.0) -> None:
        """End the loop after the step in progress, if any."""
        with self._lock:
            thread, self._thread = self._thread, None
        self._stop.set()
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _run(self) -> None:
        delay = self._interval
        while not self._stop.is_set():
            self._wake.wait(delay)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._step()
                delay = self._interval
            except Exception as exc:
                if self._max_backoff is not None:
                    delay = min(max(delay, self._interval) * 2, self._max_backoff)
                if isinstance(exc, Unavailable):  # what it needs is down, and says so itself
                    log.debug("%s: step failed (%s); next try in %.1fs", self._name, exc, delay)
                    continue
                log.exception("%s: step failed; next try in %.1fs", self._name, delay)
