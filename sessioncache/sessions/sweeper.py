"""The background sweep: expires sessions and blocks every ``interval_s`` seconds."""

from __future__ import annotations

import logging

from sessioncache.background import BackgroundLoop
from sessioncache.sessions.manager import SessionManager

log = logging.getLogger("sessioncache.sessions.sweeper")


def sweeper(sessions: SessionManager, interval_s: float) -> BackgroundLoop:
    """A loop running ``SessionManager.sweep`` every ``interval_s`` (started by ``start``)."""

    def sweep() -> None:
        report = sessions.sweep()
        if report.expired_sessions or report.expired_blocks or report.idle_unpinned:
            log.info(
                "sweep: %d sessions expired, %d idle unpinned, %d blocks expired",
                report.expired_sessions,
                report.idle_unpinned,
                report.expired_blocks,
            )

    return BackgroundLoop("sessioncache-sweeper", sweep, interval_s)
