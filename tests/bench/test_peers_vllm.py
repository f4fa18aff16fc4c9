"""``bench.peers_vllm``'s prompts and configurations (its run on real engines is the bench smoke
test's case, ``slow``)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import peers_vllm


def trace(tmp_path: Path, requests: list[list[int]]) -> Path:
    path = tmp_path / "trace_0001.json"
    rows: list[dict[str, object]] = [
        {"hash_ids": ids, "think_time": 2.0 * i} for i, ids in enumerate(requests)
    ]
    rows.insert(1, {"type": "subagent", "requests": []})  # left out
    path.write_text(json.dumps({"requests": rows}))
    return path


def test_equal_trace_blocks_give_equal_tokens_within_a_session_only(tmp_path: Path) -> None:
    path = trace(tmp_path, [[1, 2], [1, 2, 3], [1, 2, 3, 4], [1, 5]])
    one = peers_vllm.session_prompts(path, 0, 0.125, 1000, 49_152)
    other = peers_vllm.session_prompts(path, 1, 0.125, 1000, 49_152)
    assert [len(tokens) for tokens, _ in one] == [16, 24, 32, 16]
    assert [wait for _, wait in one] == [0.0, 2.0, 4.0, 6.0]
    assert one[1][0][:16] == one[0][0] and one[2][0][:24] == one[1][0]
    assert one[3][0][:8] == one[0][0][:8] and one[3][0][8:] != one[0][0][8:]
    assert one[0][0] != other[0][0]
    assert all(100 <= t < 49_152 - 100 for tokens, _ in one for t in tokens)
    cut = peers_vllm.session_prompts(path, 0, 0.125, 20, 49_152)
    assert [len(tokens) for tokens, _ in cut] == [16, 20, 20, 16]


def test_each_configuration_as_its_documentation_writes_it(tmp_path: Path) -> None:
    assert peers_vllm.transfer_config("none", None, tmp_path, 1) is None
    ours = peers_vllm.transfer_config("sessioncache", "http://n", tmp_path, 1)
    assert ours["kv_connector"] == "SessionCacheConnector"
    assert ours["kv_connector_extra_config"] == {"url": "http://n"}
    cpu = peers_vllm.transfer_config("offload-cpu", None, tmp_path, 1 << 30)
    assert cpu["kv_connector"] == "OffloadingConnector"
    assert cpu["kv_connector_extra_config"] == {"cpu_bytes_to_use": 1 << 30}
    fs = peers_vllm.transfer_config("offload-fs", None, tmp_path, 1 << 30)[
        "kv_connector_extra_config"
    ]
    assert fs["spec_name"] == "TieringOffloadingSpec"
    assert fs["secondary_tiers"] == [{"type": "fs", "root_dir": str(tmp_path / "vllm-fs")}]
    assert peers_vllm.transfer_config("lmcache", None, tmp_path, 1)["kv_connector"] == (
        "LMCacheConnectorV1"
    )
    assert set(peers_vllm.GPU_ONLY) == {"offload-cpu", "offload-fs", "lmcache"}
