"""``sessioncache serve``: run the REST API on uvicorn, and the block stream beside it."""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sessioncache.dataplane.transport import is_loopback

log = logging.getLogger("sessioncache.serve")


# uvicorn pauses reading a request body whenever 64 KiB are buffered, so a 2 MiB block upload
# costs ~32 event-loop round trips; 512 KiB windows (docs/benchmarks.md, bench/transfer.py).
BODY_READ_WINDOW = 512 << 10


def widen_body_window(limit: int = BODY_READ_WINDOW) -> None:
    """Raise uvicorn's per-connection body buffer limit (a module constant it has no option
    for) in the protocol implementations this process may use."""
    import importlib

    for name in ("httptools_impl", "h11_impl"):
        try:
            module = importlib.import_module(f"uvicorn.protocols.http.{name}")
        except ImportError:
            continue
        if hasattr(module, "HIGH_WATER_LIMIT"):
            setattr(module, "HIGH_WATER_LIMIT", limit)  # noqa: B010


NON_TEMPORAL_TUNABLE = "glibc.cpu.x86_non_temporal_threshold=0x100000"
"""glibc switches memcpy to non-temporal stores only above a threshold derived from the cache
size; 1 MiB suits the node's copies of whole blocks into its tiers (figures in
docs/benchmarks.md). glibc reads it at process start only."""


def tuned_environment(environ: Mapping[str, str]) -> dict[str, str] | None:
    """The environment to run ``serve`` in with the non-temporal threshold lowered, or None
    when there is nothing to do: ``GLIBC_TUNABLES`` already set (even empty: the operator's
    choice), or not glibc on x86-64."""
    if "GLIBC_TUNABLES" in environ:
        return None
    if platform.machine() not in ("x86_64", "AMD64") or platform.libc_ver()[0] != "glibc":
        return None
    return {**environ, "GLIBC_TUNABLES": NON_TEMPORAL_TUNABLE}


def serve_argv(args: argparse.Namespace) -> list[str]:
    """This ``serve`` command line, rebuilt from its parsed arguments."""
    argv = [sys.executable, "-m", "sessioncache.cli", "serve"]
    if args.host is not None:
        argv += ["--host", args.host]
    if args.port is not None:
        argv += ["--port", str(args.port)]
    if args.stream_port is not None:
        argv += ["--stream-port", str(args.stream_port)]
    if args.data_dir is not None:
        argv += ["--data-dir", str(args.data_dir)]
    return argv


def stream_port_for(args: argparse.Namespace, environ: Mapping[str, str]) -> int | None:
    """The block stream's port the command line asks for: ``--stream-port``, else ``--port``
    plus one (unless ``SESSIONCACHE_STREAM_PORT`` is set), so that a second node started with
    its own ``--port`` never collides with the first's stream; None: the settings' own."""
    if args.stream_port is not None:
        return int(args.stream_port)
    if args.port is not None and "SESSIONCACHE_STREAM_PORT" not in environ:
        return int(args.port) + 1 if 0 < args.port < 65535 else 0
    return None


def run(args: argparse.Namespace) -> int:
    environment = tuned_environment(os.environ)
    if environment is not None:
        # Re-run this very command with the tunable set (same pid), before anything heavy
        # is imported: glibc only reads it at start.
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, serve_argv(args), environment)

    import uvicorn

    from sessioncache.api.app import create_app
    from sessioncache.api.connections import (
        ConnectionGuard,
        Deadlines,
        TenantConnections,
        connection_cap,
        guarded_protocol,
    )
    from sessioncache.config import Settings
    from sessioncache.dataplane.samehost_server import open_samehost_server
    from sessioncache.dataplane.server import open_stream_server
    from sessioncache.errors import CatalogError
    from sessioncache.factory import open_node

    overrides: dict[str, Any] = {}
    if args.host is not None:
        overrides["host"] = args.host
    if args.port is not None:
        overrides["port"] = args.port
    stream_port = stream_port_for(args, os.environ)
    if stream_port is not None:
        overrides["stream_port"] = stream_port
    if args.data_dir is not None:
        overrides["data_dir"] = args.data_dir
    settings = Settings(**overrides)
    # REST's cap, below the descriptor limit less the data plane's connections (the stream's
    # and the same-host socket's), settled before the node takes each tenant's share of it
    data_plane = settings.stream_max_connections * (1 + settings.shm)
    cap = connection_cap(settings.http_max_connections, data_plane)
    settings = settings.model_copy(update={"http_max_connections": cap})
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not settings.api_keys:
        hosts = [settings.host] + ([settings.stream_host] if settings.stream_enabled else [])
        for host in hosts:
            if not is_loopback(host):
                print(
                    f"refusing to serve on {host} without API keys: set "
                    'SESSIONCACHE_API_KEYS=\'{"<key>": "<tenant>"}\' or bind 127.0.0.1',
                    file=sys.stderr,
                )
                return 2
        log.warning(
            "no API keys configured: serving OPEN (every caller is tenant 'default') on %s only",
            settings.host,
        )
    widen_body_window()
    try:
        node = open_node(settings)
    except CatalogError as exc:  # not there, not migrated, read-only: the message names it
        print(f"refusing to start: {exc}", file=sys.stderr)
        return 2
    log.info("GLIBC_TUNABLES=%s", os.environ.get("GLIBC_TUNABLES", ""))
    log.info(
        "tiers: %s; data dir %s",
        ", ".join(f"{t.name}={t.capacity_bytes}" for t in node.store.tiers),
        settings.data_dir.resolve(),
    )
    # what is being opened, and how to do without it, for the message should it fail
    where = f"the block stream on {settings.stream_host}:{settings.stream_port}"
    hint = "set SESSIONCACHE_STREAM_PORT, or SESSIONCACHE_STREAM_ENABLED=false"
    try:
        # bound now, so that a taken port fails the start; started by the app's lifespan
        stream = open_stream_server(node, settings)
        where = f"the same-host socket {settings.shm_socket_path()}"
        hint = "set SESSIONCACHE_SHM_SOCKET, or SESSIONCACHE_SHM=false"
        same_host = open_samehost_server(node, settings)
    except OSError as exc:
        node.close()
        print(f"cannot serve {where}: {exc} ({hint})", file=sys.stderr)
        return 2
    if same_host is not None:
        log.info("same-host path: shared-memory CPU tier on %s", same_host.address)
    app = create_app(node, stream=stream, same_host=same_host)
    deadlines = Deadlines(
        settings.http_head_timeout_s,
        settings.http_body_floor_s,
        settings.http_body_min_bytes_per_s,
    )
    tenants = None
    if node.auth_enabled:
        tenants = TenantConnections(node.tenant_for_key, node.quotas.tally("http_connections"))
    guard = ConnectionGuard(cap, deadlines, tenants)
    app.state.connections = guard
    share = f" ({node.quotas.defaults.http_connections} a tenant)" if tenants else ""
    log.info(
        "REST: at most %d connections%s, %g s for a request head, %g s of grace then %d "
        "bytes/s for a body",
        cap,
        share,
        deadlines.head_s,
        deadlines.body_floor_s,
        deadlines.body_bytes_per_s,
    )
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        http=guarded_protocol(guard),
        limit_concurrency=2 * cap,  # a backstop: the guard keeps connections at the cap
        timeout_keep_alive=int(settings.http_keepalive_s),
    )
    return 0


def register(sub: Any) -> None:
    parser = sub.add_parser("serve", help="run the REST API (uvicorn) and the block stream")
    parser.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default 8080)")
    parser.add_argument(
        "--stream-port",
        type=int,
        default=None,
        help="port of the block stream (default: --port plus one when --port is given, else "
        "SESSIONCACHE_STREAM_PORT or 8081; 0 picks a free one)",
    )
    parser.add_argument("--data-dir", type=Path, default=None, help="disk tier and catalog")
    parser.set_defaults(func=run)
