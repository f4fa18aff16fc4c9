"""Retries: transient failures (no server yet, a restart, 429/5xx) are retried with backoff;
4xx answers are not."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import pytest

from sessioncache.connector import (
    AsyncSessionCacheClient,
    ConstantBackoff,
    ExponentialBackoff,
    ExponentialWithJitterBackoff,
    InvalidRequest,
    NoBackoff,
    NotFound,
    ProtocolError,
    RateLimited,
    Retry,
    SessionCacheClient,
    TransportError,
)
from tests.support.servers import free_port, spawn_server

from .conftest import NS
from .test_client import Recording, payload, toks

WHOAMI = {"tenant": "default", "auth": False}


def test_backoffs() -> None:
    assert [ExponentialBackoff(0.1, 1.0).compute(n) for n in (1, 2, 3, 4, 5)] == [
        0.1,
        0.2,
        0.4,
        0.8,
        1.0,
    ]
    assert ConstantBackoff(0.3).compute(7) == 0.3 and NoBackoff().compute(1) == 0.0
    jitter = ExponentialWithJitterBackoff(0.1, 1.0, rng=random.Random(0))
    assert all(0 <= jitter.compute(n) <= min(1.0, 0.1 * 2 ** (n - 1)) for n in range(1, 20))
    with pytest.raises(ValueError):
        Retry(NoBackoff(), attempts=0)


def flaky(statuses: list[int], calls: list[str]) -> httpx.MockTransport:
    """Answers each status in turn (then 200 whoami), recording the paths asked."""

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if statuses:
            status = statuses.pop(0)
            if status == 0:
                raise httpx.ConnectError("refused", request=request)
            if status == -1:
                raise httpx.ReadTimeout("slow", request=request)
            headers = {"retry-after": "0"} if status == 429 else {}
            return httpx.Response(
                status, json={"error": "E", "detail": str(status)}, headers=headers
            )
        return httpx.Response(200, json=WHOAMI)

    return httpx.MockTransport(handler)


@pytest.mark.parametrize("statuses", [[503, 502], [429, 504], [0, -1]])
def test_transient_errors_are_retried(statuses: list[int]) -> None:
    calls: list[str] = []
    backoff = Recording()
    with SessionCacheClient(
        "http://sc", namespace=NS, retry=Retry(backoff, 3), transport=flaky(statuses, calls)
    ) as c:
        assert c.whoami().tenant == "default"
    assert backoff.failures == [1, 2] and len(calls) == 3


def test_retries_give_up_after_the_attempts() -> None:
    calls: list[str] = []
    backoff = Recording()
    with (
        SessionCacheClient(
            "http://sc",
            namespace=NS,
            retry=Retry(backoff, 2),
            transport=flaky([503, 429, 503], calls),
        ) as c,
        pytest.raises(RateLimited) as info,
    ):
        c.whoami()
    assert info.value.retry_after == 0.0 and backoff.failures == [1] and len(calls) == 2
    with (
        SessionCacheClient(
            "http://sc", namespace=NS, retry=Retry(NoBackoff(), 1), transport=flaky([0], [])
        ) as c,
        pytest.raises(TransportError),
    ):
        c.whoami()


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 413, 422, 500])
def test_other_errors_are_not_retried(status: int) -> None:
    calls: list[str] = []
    backoff = Recording()
    with (
        SessionCacheClient(
            "http://sc", namespace=NS, retry=Retry(backoff, 5), transport=flaky([status], calls)
        ) as c,
        pytest.raises(Exception) as info,
    ):
        c.whoami()
    assert getattr(info.value, "status", None) == status
    assert backoff.failures == [] and len(calls) == 1
    assert isinstance(info.value, NotFound) == (status == 404)


def test_async_retries_mirror_the_sync_ones() -> None:
    calls: list[str] = []
    backoff = Recording()

    async def main() -> None:
        async with AsyncSessionCacheClient(
            "http://sc", namespace=NS, retry=Retry(backoff, 3), transport=flaky([0, 503], calls)
        ) as c:
            assert (await c.whoami()).tenant == "default"
        async with AsyncSessionCacheClient(
            "http://sc", namespace=NS, retry=Retry(backoff, 3), transport=flaky([422], calls)
        ) as c:
            with pytest.raises(InvalidRequest):
                await c.whoami()

    asyncio.run(main())
    assert backoff.failures == [1, 2] and len(calls) == 4


def test_a_malformed_answer_is_a_protocol_error() -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(200, content=b"SCB1garbage"))
    with SessionCacheClient("http://sc", namespace=NS, transport=transport) as c:
        with pytest.raises(ProtocolError):
            c.load([bytes(16)])
        with pytest.raises(ProtocolError):
            c.whoami()


def test_a_late_and_a_restarted_server(tmp_path: Path) -> None:
    """No server yet: the client retries until one answers; the server restarts between two
    calls: the client retries again, and durable blocks are still there."""
    port = free_port()
    backoff = Recording(delay=0.1)
    tokens = toks(20, 24)
    server = spawn_server(tmp_path / "data", port=port)  # answers only seconds from now
    try:
        with SessionCacheClient(
            server.url, namespace=NS, retry=Retry(backoff, attempts=300), timeout=5
        ) as c:
            assert c.store(tokens, payload).stored == 3
            first = len(backoff.failures)
            assert first >= 1  # it was refused at least once before the server was up
            server.stop()
            server = spawn_server(tmp_path / "data", port=port)
            found = c.lookup(tokens)
            assert len(backoff.failures) > first
            assert found.matched_blocks == 3
            assert c.load(found.hashes) == [payload(i) for i in range(3)]
    finally:
        server.stop()
