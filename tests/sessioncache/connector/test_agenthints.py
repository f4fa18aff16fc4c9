"""An engine request's agent hints (``connector.agenthints``), against a real node process: the
hints a vLLM request carries in ``kv_transfer_params`` and ``extra_args`` reach its session on
the stream and the same-host socket; a malformed hint, a hint naming no session and a node that is
down are logged warnings, never an exception into the engine."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from sessioncache.connector import SessionCacheClient
from sessioncache.connector.agenthints import forward, request_hints
from sessioncache.connector.paged import EngineNode, NodeSettings, Scope
from sessioncache.errors import InvalidInput
from sessioncache.hashing import Namespace
from tests.support.servers import Server, start_server

KEYS = {"key-a": "ta", "key-b": "tb"}


@dataclass
class Sampling:
    extra_args: dict[str, Any] | None = None


@dataclass
class Request:
    """What of a vLLM ``Request`` the hints are read from."""

    kv_transfer_params: dict[str, Any] | None
    sampling_params: Sampling = field(default_factory=Sampling)
    request_id: str = "req-1"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("agenthints") / "data",
        {
            "SESSIONCACHE_API_KEYS": json.dumps(KEYS),
            "SESSIONCACHE_SHM_TRUSTED_TENANTS": json.dumps(sorted(KEYS.values())),
        },
    )
    yield server
    server.stop()


def session(node: Server, sid: str, key: str = "key-a") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.get(f"{node.url}/v1/sessions/{sid}", headers=headers, timeout=10)


def test_request_hints_collects_each_carrier():
    params = {"session_id": "s", "agent_hint": {"schema_version": 1}, "agent_hints": None}
    extra = {"retention_directives": [{"start": 0, "priority": 10}], "retention_scope": "x"}
    extra |= {"kv_transfer_params": params}
    assert request_hints(params, extra) == {
        "agent_hint": {"schema_version": 1},
        "retention_directives": [{"start": 0, "priority": 10}],
        "retention_scope": "x",
    }
    assert request_hints(None, None) == {} and request_hints({"session_id": "s"}, {}) == {}


@pytest.mark.parametrize("path", ["stream", "same_host"])
def test_a_requests_hints_reach_its_session(node: Server, path: str):
    engine = EngineNode(NodeSettings(node.url, api_key="key-a", data_path=path))
    sid = f"hinted-{path}"
    try:
        params = {
            "session_id": sid,
            "agent_hint": {"schema_version": 1, "trajectory_id": sid, "kv_priority": 80},
            "agent_hints": {"cache_ttl_ms": 900_000},
        }
        extra = {"retention_directives": [{"start": 0, "end": None, "priority": 40}]}
        request = Request(params, Sampling(extra))
        assert forward(engine, request, Scope(session_id=sid), 16)  # opens the session
        got = session(node, sid).json()
        assert got["hint"]["ttl_s"] == 900 and got["hint"]["priority"] == 40
        assert session(node, sid, "key-b").status_code == 404  # the engine's tenant's
        # the hint's own session id, where the request names none
        final = Request({"agent_hints": {"workflow_id": sid, "final": True}})
        assert forward(engine, final, Scope(), 16)
        assert session(node, sid).json()["hint"]["final"] is True
    finally:
        engine.close()


def test_a_malformed_hint_or_a_down_node_is_a_warning(
    node: Server, caplog: pytest.LogCaptureFixture
):
    engine = EngineNode(NodeSettings(node.url, api_key="key-a", data_path="stream"))
    caplog.set_level(logging.WARNING, logger="vllm.sessioncache")
    try:
        bad = Request({"session_id": "s", "agent_hints": {"reuse_hint": "always"}})
        assert not forward(engine, bad, Scope(session_id="s"), 16)
        assert "agent hint ignored" in caplog.text and "reuse_hint" in caplog.text
        # a session only the hint names is not opened for it
        elsewhere = Request({"agent_hints": {"workflow_id": "never-opened", "cache_ttl_ms": 5}})
        assert not forward(engine, elsewhere, Scope(), 16)
        assert "agent hint not sent" in caplog.text
        assert session(node, "never-opened").status_code == 404
        nameless = Request({"agent_hints": {"cache_ttl_ms": 5}})
        assert not forward(engine, nameless, Scope(), 16)
        assert "no session_id" in caplog.text
        assert not forward(engine, Request({"session_id": "s"}), Scope(session_id="s"), 16)
    finally:
        engine.close()
    gone = EngineNode(NodeSettings("http://127.0.0.1:9", api_key="key-a", data_path="stream"))
    try:
        good = Request({"session_id": "s", "agent_hints": {"cache_ttl_ms": 5}})
        assert not forward(gone, good, Scope(session_id="s"), 16)
        assert "agent hint not sent" in caplog.text
    finally:
        gone.close()


def test_the_rest_client_sends_a_hint(node: Server):
    ns = Namespace("agenthints-model", 16, "bf16", "x")
    with SessionCacheClient(node.url, namespace=ns, api_key="key-a") as client:
        client.open_session("rest-hinted")
        assert client.hint_session("rest-hinted", {"agent_hints": {"reuse_hint": "keep"}}).id
        assert session(node, "rest-hinted").json()["hint"]["priority"] == 100
        directives = {"retention_directives": [{"start": 0, "end": 32, "priority": 70}]}
        assert client.hint_session("rest-hinted", directives, block_tokens=16).pinned is False
        with pytest.raises(InvalidInput, match="reuse_hint"):
            client.hint_session("rest-hinted", {"agent_hints": {"reuse_hint": "always"}})
