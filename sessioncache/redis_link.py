"""The connection to Redis that the shared tier and the fleet index share: the client, its
health, and sends that copy no block.

``make_client(url)`` builds a synchronous redis-py client (``redis.Redis``, or ``RedisCluster``
for a ``redis+cluster://`` URL) whose failures are cheap: short timeouts and a few fast
retries. ``client_factory(url)`` defers that, so a node starts while Redis is down.

``RedisLink`` holds one client plus the health its users share. Every call that meets a
connection error, timeout or cluster outage raises ``TierUnavailable`` and marks the link
degraded. While degraded, calls fail at once without touching the network; at most once per
``probe_interval_s`` one call probes with a ``PING`` and, when it answers, the link is healthy
again. ``problem()`` and ``status()`` report the state for ``/readyz`` and ``/metrics``.

``Parts`` is one bulk-string argument made of several buffers (a block header and the caller's
payload). The connection classes ``make_client`` installs send its buffers to the socket as
they are, so no value is assembled by copying; ``sends_parts(client)`` says whether a client
can. Other clients need a contiguous value.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias, TypeVar, cast

import redis
import redis.connection
import redis.exceptions as rex
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from sessioncache.errors import InvalidInput, TierUnavailable

__all__ = [
    "REDIS_URL_ENV",
    "UNAVAILABLE_ERRORS",
    "Client",
    "LinkStatus",
    "Parts",
    "RedisLink",
    "TierUnavailable",
    "client_factory",
    "describe_error",
    "make_client",
    "sends_parts",
]

logger = logging.getLogger("sessioncache.redis_link")

Client: TypeAlias = "redis.Redis | RedisCluster"
"""A synchronous redis-py client: one server (or Sentinel-managed primary) or a cluster."""

REDIS_URL_ENV = "SESSIONCACHE_REDIS_URL"
_T = TypeVar("_T")

# What "Redis is not there" looks like through redis-py: connection and socket failures,
# timeouts, a cluster without a covering primary, a replica promoted mid-write.
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    rex.ConnectionError,  # includes BusyLoadingError, MaxConnectionsError
    rex.TimeoutError,
    rex.ClusterError,  # ClusterDownError, MasterDownError
    rex.RedisClusterException,  # SlotNotCoveredError, no reachable startup node
    rex.TryAgainError,
    rex.ReadOnlyError,
    OSError,
)
_PROBE_ERRORS: tuple[type[BaseException], ...] = (*UNAVAILABLE_ERRORS, rex.RedisError)


# --------------------------------------------------------------------------------- clients


def make_client(
    url: str | None = None,
    *,
    connect_timeout_s: float = 0.2,
    timeout_s: float = 0.5,
    retries: int = 2,
    backoff_base_s: float = 0.005,
    backoff_cap_s: float = 0.05,
    max_connections: int | None = None,
) -> Client:
    """A client for ``url`` (default: ``$SESSIONCACHE_REDIS_URL``) whose failures are cheap.

    ``redis://host:port/db`` (or ``rediss://``, ``unix://``) gives ``redis.Redis``;
    ``redis+cluster://host:port`` (or ``rediss+cluster://``) gives ``redis.RedisCluster``
    seeded from that node. Connection errors and timeouts are retried ``retries`` times with
    exponential backoff between ``backoff_base_s`` and ``backoff_cap_s``, so a dead Redis
    costs a few milliseconds per call, not seconds. ``redis.Redis`` connects lazily; a
    ``RedisCluster`` connects here and raises if no node answers (use ``client_factory``
    to let the tier create it once the cluster is up).
    """
    url = url or os.environ.get(REDIS_URL_ENV)
    if not url:
        raise InvalidInput(f"no Redis URL: pass one or set {REDIS_URL_ENV}")
    retry = Retry(ExponentialBackoff(cap=backoff_cap_s, base=backoff_base_s), retries)
    kwargs: dict[str, Any] = {
        "socket_connect_timeout": connect_timeout_s,
        "socket_timeout": timeout_s,
        "retry": retry,
    }
    if max_connections is not None:
        kwargs["max_connections"] = max_connections
    scheme, sep, rest = url.partition("://")
    cluster = bool(sep) and scheme.endswith("+cluster")
    scheme = scheme.removesuffix("+cluster")
    kwargs["connection_class"] = {"rediss": _SslConnection, "unix": _UnixConnection}.get(
        scheme, _TcpConnection
    )
    if cluster:
        return RedisCluster.from_url(f"{scheme}://{rest}", **kwargs)
    return redis.Redis.from_url(url, **kwargs)


def client_factory(url: str | None = None, **options: Any) -> Callable[[], Client]:
    """A zero-argument callable making ``make_client(url, **options)``: hand it to
    ``RedisTier``/``FleetIndex`` so a node starts even while Redis is down."""
    url = url or os.environ.get(REDIS_URL_ENV)
    if not url:
        raise InvalidInput(f"no Redis URL: pass one or set {REDIS_URL_ENV}")
    return lambda: make_client(url, **options)


@dataclass(frozen=True, slots=True)
class LinkStatus:
    """The health of a ``RedisLink`` (for ``/readyz`` and ``/metrics``)."""

    healthy: bool
    reason: str | None
    degraded_since: float | None
    """Wall-clock time the link last went down, None while healthy."""
    failures: int
    """Times the link went from healthy to degraded."""
    recoveries: int
    """Times it came back."""


class RedisLink:
    """One client plus the health state its users share (see the module docstring).

    ``run(op)`` calls ``op(client)``; on an outage it raises ``TierUnavailable`` and marks
    the link degraded. While degraded, ``run`` raises at once, except that one call per
    ``probe_interval_s`` first sends a ``PING`` and resumes when it answers. Listeners added
    with ``on_recover`` run (in the probing thread, so they must be quick) when it does.
    """

    def __init__(
        self,
        client: Client | Callable[[], Client],
        *,
        name: str = "redis",
        probe_interval_s: float = 1.0,
    ) -> None:
        self.name: Final = name
        self._probe_interval = probe_interval_s
        self._factory: Callable[[], Client] | None
        self._client: Client | None
        if isinstance(client, redis.Redis | RedisCluster):
            self._factory, self._client = None, client
        else:
            self._factory, self._client = client, None
        self._owns_client = self._factory is not None
        self._lock = threading.Lock()
        self._probe_lock = threading.Lock()
        self._healthy = self._client is not None
        self._reason: str | None = None if self._healthy else "not connected yet"
        self._since: float | None = None if self._healthy else time.time()
        self._next_probe = 0.0
        self._last_ok = float("-inf")
        self._failures = 0
        self._recoveries = 0
        self._listeners: list[Callable[[], None]] = []

    @classmethod
    def of(
        cls,
        client: Client | Callable[[], Client] | RedisLink,
        *,
        name: str,
        probe_interval_s: float,
    ) -> RedisLink:
        """``client`` itself when it is a link already (shared with its other users; ``name``
        and ``probe_interval_s`` are its own), else a new link over it."""
        if isinstance(client, RedisLink):
            return client
        return cls(client, name=name, probe_interval_s=probe_interval_s)

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def client(self) -> Client | None:
        """The client, or None while a factory has not managed to make one."""
        return self._client

    def on_recover(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def status(self) -> LinkStatus:
        with self._lock:
            return LinkStatus(
                self._healthy, self._reason, self._since, self._failures, self._recoveries
            )

    def problem(self) -> str | None:
        """None when Redis answers; otherwise why not. Sends a ``PING`` when nothing has been
        heard from Redis for ``probe_interval_s`` (so an idle node notices an outage too)."""
        if self._healthy and time.monotonic() - self._last_ok < self._probe_interval:
            return None
        try:
            self.run(lambda c: c.ping())
        except TierUnavailable:
            return f"{self.name}: {self._reason}"
        except rex.RedisError as exc:  # answering, if oddly (e.g. NOAUTH): report it
            return f"{self.name}: {describe_error(exc)}"
        return None

    def run(self, op: Callable[[Client], _T]) -> _T:
        client = self._ready()
        try:
            result = op(client)
        except UNAVAILABLE_ERRORS as exc:
            self.mark_failed(exc)
            raise TierUnavailable(f"{self.name}: {describe_error(exc)}") from exc
        self._last_ok = time.monotonic()
        return result

    def pipeline(self, queue: Callable[[Any], object], *, raise_errors: bool = True) -> list[Any]:
        """Run the commands ``queue(pipe)`` adds in one non-transactional pipeline (split per
        node on a cluster). An outage among the replies marks the link degraded and raises
        ``TierUnavailable``; any other error reply is raised too, or with
        ``raise_errors=False`` left in its slot."""

        def op(c: Client) -> list[Any]:
            pipe = c.pipeline(transaction=False)
            queue(pipe)
            return cast(list[Any], pipe.execute(raise_on_error=False))

        replies = self.run(op)
        for reply in replies:
            if isinstance(reply, UNAVAILABLE_ERRORS):
                self.mark_failed(reply)
                raise TierUnavailable(f"{self.name}: {describe_error(reply)}") from reply
        if raise_errors:
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return replies

    def mark_failed(self, exc: BaseException) -> None:
        reason = describe_error(exc)
        with self._lock:
            self._next_probe = time.monotonic() + self._probe_interval
            self._reason = reason
            if self._healthy:
                self._healthy = False
                self._since = time.time()
                self._failures += 1
                logger.warning("%s unreachable, degraded: %s", self.name, reason)

    def close(self) -> None:
        """Close the client if this link made it (a client handed in belongs to the caller)."""
        client, self._client = self._client, None
        if client is not None and self._owns_client:
            client.close()

    def _ready(self) -> Client:
        client = self._client
        if self._healthy and client is not None:
            return client
        # Before the first connection attempt everyone waits for it; once Redis has failed,
        # only one caller per interval probes and the others fail at once.
        if self._next_probe == 0.0:
            self._probe_lock.acquire()
        elif time.monotonic() < self._next_probe or not self._probe_lock.acquire(blocking=False):
            raise TierUnavailable(f"{self.name}: {self._reason}")
        try:
            if self._healthy and self._client is not None:  # another thread got there first
                return self._client
            try:
                if self._client is None:
                    assert self._factory is not None
                    self._client = self._factory()
                self._client.ping()
            except _PROBE_ERRORS as exc:
                self.mark_failed(exc)
                raise TierUnavailable(f"{self.name}: {describe_error(exc)}") from exc
            with self._lock:
                self._healthy = True
                self._reason = None
                self._since = None
                self._recoveries += 1
            client = self._client
        finally:
            self._probe_lock.release()
        logger.warning("%s reachable again, resuming", self.name)
        for listener in list(self._listeners):
            try:
                listener()
            except Exception:
                logger.exception("%s: recovery listener failed", self.name)
        return client


def describe_error(exc: BaseException) -> str:
    """``"Type: message"``, at most 200 characters: how logs and ``problem()`` name a failure."""
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:200]


# ------------------------------------------------------------------- zero-copy block values


class Parts:
    """One bulk-string argument sent as several buffers (header, payload), so a block value
    is never assembled by copying. Only connections made by ``make_client`` can send it."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, *parts: memoryview) -> None:
        self.parts = parts
        self.nbytes = sum(p.nbytes for p in parts)


class _PartsConnection:
    """Mixed into redis-py's connection classes: packs ``Parts`` arguments as a RESP bulk
    string whose buffers go to the socket as they are (everything else is packed as usual).
    Overrides only the public ``pack_command``/``pack_commands``/``send_command``."""

    def pack_command(self, *args: Any) -> list[bytes | memoryview]:
        if not any(isinstance(a, Parts) for a in args):
            return cast(list[bytes | memoryview], super().pack_command(*args))  # type: ignore[misc]
        encode = self.encoder.encode  # type: ignore[attr-defined]
        out: list[bytes | memoryview] = []
        buff = b"*%d\r\n" % len(args)
        for arg in args:
            if isinstance(arg, Parts):
                out.append(buff + b"$%d\r\n" % arg.nbytes)
                out.extend(arg.parts)
                buff = b"\r\n"
            else:
                value = bytes(encode(arg))
                buff += b"$%d\r\n%s\r\n" % (len(value), value)
        out.append(buff)
        return out

    def pack_commands(self, commands: Iterable[Sequence[Any]]) -> list[bytes | memoryview]:
        # redis-py's own loop, over this class's pack_command: small chunks are joined, big
        # ones and memoryviews are sent as they are.
        cutoff: int = self._buffer_cutoff  # type: ignore[attr-defined]
        output: list[bytes | memoryview] = []
        pieces: list[bytes] = []
        length = 0
        for cmd in commands:
            for chunk in self.pack_command(*cmd):
                big = len(chunk) > cutoff or isinstance(chunk, memoryview)
                if length > cutoff or big:
                    if pieces:
                        output.append(b"".join(pieces))
                    length = 0
                    pieces = []
                if big:
                    output.append(chunk)
                else:
                    pieces.append(cast(bytes, chunk))
                    length += len(chunk)
        if pieces:
            output.append(b"".join(pieces))
        return output

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        self.send_packed_command(  # type: ignore[attr-defined]
            self.pack_command(*args), check_health=kwargs.get("check_health", True)
        )


class _TcpConnection(_PartsConnection, redis.connection.Connection):
    pass


class _SslConnection(_PartsConnection, redis.connection.SSLConnection):
    pass


class _UnixConnection(_PartsConnection, redis.connection.UnixDomainSocketConnection):
    pass


def sends_parts(client: Client) -> bool:
    """Whether every connection of ``client`` can send ``Parts`` (made by ``make_client``)."""
    try:
        if isinstance(client, RedisCluster):
            cls = client.nodes_manager.connection_kwargs.get("connection_class")
        else:
            cls = client.connection_pool.connection_class
    except AttributeError:
        return False
    return isinstance(cls, type) and issubclass(cls, _PartsConnection)
