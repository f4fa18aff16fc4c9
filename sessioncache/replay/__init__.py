"""Trace replay: the eviction policy's report card (``sessioncache replay``).

Drives the production ``TieredStore``, ``EvictionPolicy`` and ``SessionManager`` with a
``ManualClock`` over real request traces, on ``AccountingTier``s (payload sizes are accounted,
no bytes are allocated), and compares their token hit rate with an infinite cache (the oracle),
a plain LRU and a 5-minute sliding TTL at the same capacity.

* ``trace``: loading Mooncake JSONL files and folders of agentic session files.
* ``simulators``: the caches under comparison.
* ``runner``: replaying a trace through each of them and scoring the hit rates.
* ``report``: the text report and the hit-rate-vs-capacity plot.
"""

from sessioncache.replay.runner import (
    DEFAULT_TIERS,
    EXTRA_POLICIES,
    POLICIES,
    PolicyResult,
    ReplayReport,
    run_capacity_sweep,
    run_replay,
)
from sessioncache.replay.trace import Request, Trace, load_trace

__all__ = [
    "DEFAULT_TIERS",
    "EXTRA_POLICIES",
    "POLICIES",
    "PolicyResult",
    "ReplayReport",
    "Request",
    "Trace",
    "load_trace",
    "run_capacity_sweep",
    "run_replay",
]
