"""The periodic loop behind the sweeper, the catalog flusher, the expiry refresher and the
fleet heartbeat."""

from __future__ import annotations

import threading

import pytest

from sessioncache.background import BackgroundLoop


def test_steps_run_periodically_and_on_wake_until_stopped():
    ran = threading.Semaphore(0)
    loop = BackgroundLoop("test-loop", ran.release, 3600.0)
    assert not loop.running
    loop.start()
    loop.start()  # idempotent
    assert loop.running
    loop.wake()
    assert ran.acquire(timeout=5)
    loop.stop()
    assert not loop.running
    loop.wake()
    assert not ran.acquire(timeout=0.2)


def test_a_failing_step_is_retried_with_backoff():
    calls: list[int] = []
    done = threading.Event()

    def step() -> None:
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("boom")
        done.set()

    loop = BackgroundLoop("test-failing", step, 0.01, max_backoff_s=0.05)
    loop.start()
    try:
        assert done.wait(5)
    finally:
        loop.stop()
    assert len(calls) >= 3


def test_interval_must_be_positive():
    with pytest.raises(ValueError):
        BackgroundLoop("bad", lambda: None, 0)
