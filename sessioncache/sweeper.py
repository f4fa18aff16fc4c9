"""The background sweep: expires sessions and blocks every ``interval_s`` seconds."""

from __future__ import annotations

import logging
import threading

from sessioncache.sessions import SessionManager, SweepReport

log = logging.getLogger("sessioncache.sweeper")


class Sweeper:
    """A daemon thread running ``SessionManager.sweep``; started by ``start``, not on creation."""

    def __init__(self, sessions: SessionManager, interval_s: float) -> None:
        self._sessions = sessions
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_report: SweepReport | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="sessioncache-sweeper", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                report = self._sessions.sweep()
            except Exception:
                log.exception("sweep failed; retrying next period")
                continue
            self.last_report = report
            if report.expired_sessions or report.expired_blocks or report.idle_unpinned:
                log.info(
                    "sweep: %d sessions expired, %d idle unpinned, %d blocks expired",
                    report.expired_sessions,
                    report.idle_unpinned,
                    report.expired_blocks,
                )
