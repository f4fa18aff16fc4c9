"""The one error table: each class that crosses a wire comes back as itself over HTTP and over
the stream, the clients decode by name first, and the client package loads no server."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sessioncache import errors
from sessioncache.connector import errors as connector_errors
from sessioncache.errors import (
    TABLE,
    AuthRefused,
    BlockNotFound,
    ErrorCode,
    NotFound,
    RemoteError,
    SessionCacheError,
    Unavailable,
    from_http,
    from_stream,
    http_status,
    stream_code,
)


@pytest.mark.parametrize("row", TABLE, ids=lambda row: row.cls.__name__)
def test_every_class_comes_back_as_itself(row: errors.Row) -> None:
    exc = row.cls("why")
    assert http_status(exc) == row.http
    back = from_http(row.http, row.cls.__name__, "why")
    assert type(back) is row.cls and back.status == row.http and back.detail == "why"
    if row.code is not None:
        assert stream_code(exc) == row.code
        over_stream = from_stream(row.code, "why")
        assert isinstance(over_stream, row.cls) and over_stream.code == row.code


def test_each_stream_code_names_one_class() -> None:
    codes = [row.code for row in TABLE if row.code is not None]
    for code in ErrorCode:
        assert isinstance(from_stream(code, "m"), SessionCacheError)
    assert len(codes) == len(set(codes)) == len(ErrorCode)


def test_unknown_answers_decode_by_status_then_as_remote_errors() -> None:
    assert type(from_http(404, "HTTPError", "no route")) is NotFound
    assert type(from_http(502, "HTTPError", "bad gateway")) is Unavailable
    assert type(from_http(418, "Teapot", "?")) is RemoteError
    # a name whose class has another status is not trusted over the status
    assert type(from_http(404, "AuthRefused", "x")) is NotFound
    assert type(from_stream(999, "m")) is RemoteError
    assert http_status(ValueError("not ours")) == 500
    assert stream_code(ValueError("not ours")) == ErrorCode.INTERNAL


def test_the_connector_names_are_the_core_classes() -> None:
    assert connector_errors.AuthError is AuthRefused
    assert connector_errors.BlockNotFound is BlockNotFound
    assert issubclass(connector_errors.SessionNotFound, KeyError)
    assert connector_errors.InvalidRequest is errors.InvalidInput
    assert str(BlockNotFound("gone")) == "gone"  # KeyError would quote it


def test_the_client_package_loads_no_server_and_no_torch() -> None:
    code = (
        "import sys\n"
        "import sessioncache.connector, sessioncache.connector.transfer\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('sessioncache.node',"
        " 'sessioncache.store', 'sessioncache.dataplane.server', 'sessioncache.operations',"
        " 'sessioncache.api', 'fastapi'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
