"""``SessionCacheL2`` with LMCache's own code (``lmcache==0.5.6``) against a real node:
``lmcache bench l2 --no-skip-verify`` stores, looks up and loads through it; ``lmcache server``
boots with it on the CPU; and its native interface directly, on both data paths."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sessioncache.connector.lmcache import SessionCacheL2, parse_key
from sessioncache.errors import InvalidInput
from tests.sessioncache.connector.conftest import received_bytes
from tests.support.adapters import wait_for
from tests.support.servers import Server, free_port, start_server

LMCACHE = [sys.executable, "-c", "from lmcache.cli.main import main; main()"]
ENV = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"}
ROOT_DIR = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("lmcache") / "data")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def native_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The native interface's own node: nothing LMCache's bench or server left on ``node``
    (their connections' stages, their blocks) is in its counts. Its CPU tier holds several
    64 MiB chunks: its tests store blocks of two sizes (8 KiB and 256 KiB), and in a tier of
    one chunk the second size gets room only once the first size's blocks have been written
    behind and evicted, which a busy disk can delay past a store's wait (its blocks dropped)."""
    server = start_server(
        tmp_path_factory.mktemp("lmcache-native") / "data",
        {"SESSIONCACHE_CPU_BYTES": str(256 << 20)},
    )
    yield server
    server.stop()


def adapter_json(node: Server, **params: object) -> str:
    return json.dumps(
        {
            "type": "native_plugin",
            "module_path": "sessioncache.connector.lmcache",
            "class_name": "SessionCacheL2",
            "adapter_params": {"url": node.url, **params},
        }
    )


def lmcache_env() -> dict[str, str]:
    return {**ENV, "PYTHONPATH": os.pathsep.join([str(ROOT_DIR), ENV.get("PYTHONPATH", "")])}


def dataplane(node: Server) -> dict[str, object]:
    answer: dict[str, object] = httpx.get(f"{node.url}/v1/dataplane", timeout=10).json()
    return answer


def test_lmcache_bench_l2_passes_store_lookup_and_load(node: Server):
    run = subprocess.run(
        [
            *LMCACHE,
            "bench",
            "l2",
            "--l2-adapter",
            adapter_json(node),
            "--no-skip-verify",
            "--num-keys",
            "16",
            "--data-size-kb",
            "256",
            "--rounds",
            "1",
            "--warmup-rounds",
            "1",
            "--lookup-max-hit-rate",
            "1.0",
        ],
        env=lmcache_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = run.stdout
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "All 16 keys data verified OK" in out, out[-3000:]
    assert re.findall(r"Total success:\s+(\d+)", out) == ["16", "16", "16"], out[-3000:]
    assert re.search(r"Actual hit rate:\s+1\.00", out), out[-3000:]


def test_lmcache_server_boots_with_the_adapter(node: Server, tmp_path: Path):
    before = int(dataplane(node)["same_host_connections"])  # type: ignore[call-overload]
    log = (tmp_path / "lmcache-server.log").open("w+")
    server = subprocess.Popen(
        [
            *LMCACHE,
            "server",
            "--port",
            str(free_port()),
            "--http-port",
            str(free_port()),
            "--l1-size-gb",
            "0.1",
            "--eviction-policy",
            "LRU",
            "--disable-observability",
            "--l2-adapter",
            adapter_json(node),
        ],
        env=lmcache_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 180
        text = ""
        while time.monotonic() < deadline and server.poll() is None:
            text = Path(log.name).read_text()
            if "cache server is running" in text:
                break
            time.sleep(0.5)
        assert "cache server is running" in text, text[-3000:]
        assert "Created native plugin L2 adapter: sessioncache.connector.lmcache" in text
        # the adapter holds its connection to the node: the same-host path here
        assert int(dataplane(node)["same_host_connections"]) > before  # type: ignore[call-overload]
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


# -- the native interface directly ----------------------------------------------------------------


def key(chunk: int, *, rank: int = 0, salt: str | None = None, model: str = "m/x") -> str:
    text = f"{model}@{rank:08x}@0@{chunk:032x}"
    return f"{text}@{salt}" if salt else text


@pytest.mark.parametrize("data_path", ["stream", "same_host"])
def test_native_interface_round_trip(native_node: Server, data_path: str):
    node = native_node
    adapter = SessionCacheL2(node.url, data_path=data_path, kv_layout=f"native-{data_path}")  # type: ignore[arg-type]
    try:
        assert adapter.data_path == data_path
        size = 8192
        keys = [key(i) for i in range(6)]
        payloads = [bytes([i + 1]) * size for i in range(6)]
        stored = wait_for(adapter, adapter.submit_batch_set(keys[:4], payloads[:4]))
        assert stored[1:3] == (True, "")
        # a salted key (another user) with the same chunk hash is another block
        salted = key(0, salt="user-b")
        stored = wait_for(adapter, adapter.submit_batch_set([salted], [memoryview(b"\xee" * size)]))
        assert stored[1]

        asked = [keys[5], keys[0], keys[4], keys[3], salted, key(0, rank=1)]
        found = wait_for(adapter, adapter.submit_batch_exists(asked))
        assert found[1:] == (True, "", [False, True, False, True, True, False])

        out = [bytearray(size) for _ in asked]
        got = wait_for(adapter, adapter.submit_batch_get(asked, [memoryview(b) for b in out]))
        assert got[1:] == (True, "", [False, True, False, True, True, False])
        assert out[1] == payloads[0] and out[3] == payloads[3] and out[4] == b"\xee" * size
        assert out[0] == bytearray(size)  # a miss leaves its buffer alone

        bad = wait_for(adapter, adapter.submit_batch_exists(["not-a-key"]))
        assert bad[1] is False and "not an LMCache key" in bad[2]
    finally:
        adapter.close()


def prompt_tokens(node: Server) -> tuple[float, float]:
    """The node's hit and miss tokens (``/metrics``)."""
    text = httpx.get(f"{node.url}/metrics", timeout=10).text
    found = dict(re.findall(r"^sessioncache_(hit|miss)_tokens_total (\S+)$", text, re.M))
    return float(found["hit"]), float(found["miss"])


@pytest.mark.parametrize("data_path", ["stream", "same_host"])
def test_a_set_sends_only_the_blocks_the_node_lacks(native_node: Server, data_path: str):
    """Held keys' payloads never reach the node (its received payload bytes say so), and the
    check is not a prompt's question (no hit or miss tokens)."""
    node = native_node
    adapter = SessionCacheL2(node.url, data_path=data_path, kv_layout=f"resend-{data_path}")  # type: ignore[arg-type]
    try:
        size = 256 << 10
        keys = [key(100 + i) for i in range(8)]
        payloads = [bytes([i + 1]) * size for i in range(8)]
        before = received_bytes(node, data_path)
        stored = wait_for(adapter, adapter.submit_batch_set(keys[:6], payloads[:6]))
        assert stored[1:3] == (True, "")
        assert received_bytes(node, data_path) - before == 6 * size
        tokens = prompt_tokens(node)
        before = received_bytes(node, data_path)
        again = [b"\xff" * size] * 6
        assert wait_for(adapter, adapter.submit_batch_set(keys[:6], again))[1:3] == (True, "")
        assert received_bytes(node, data_path) == before  # no payload crossed
        # held and new keys in one batch: only the new ones are sent
        assert wait_for(adapter, adapter.submit_batch_set(keys, payloads))[1:3] == (True, "")
        assert received_bytes(node, data_path) - before == 2 * size
        assert prompt_tokens(node) == tokens  # the checks counted nothing

        out = [bytearray(size) for _ in keys]
        got = wait_for(adapter, adapter.submit_batch_get(keys, [memoryview(b) for b in out]))
        assert got[1:] == (True, "", [True] * 8)
        assert [bytes(b) for b in out] == payloads
    finally:
        adapter.close()


def test_keys_map_to_namespace_and_block_key():
    plain = parse_key("meta-llama/Llama-3.1-8B@00000003@1@" + "ab" * 16)
    salted = parse_key("meta-llama/Llama-3.1-8B@00000003@1@" + "ab" * 16 + "@alice")
    assert plain.model == salted.model == "meta-llama/Llama-3.1-8B"
    assert plain.salt is None and salted.salt == "alice"
    assert plain.block_key == salted.block_key and len(plain.block_key) == 16
    other_rank = parse_key("meta-llama/Llama-3.1-8B@00000004@1@" + "ab" * 16)
    assert other_rank.block_key != plain.block_key
    for bad in ("x", "m@1@2", "@1@2@3", "m@1@2@3@4@5"):
        with pytest.raises(InvalidInput):
            parse_key(bad)


def test_the_core_never_imports_lmcache():
    code = (
        "import sys, sessioncache, sessioncache.connector, sessioncache.connector.lmcache, "
        "sessioncache.dataplane, sessioncache.api.app; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'lmcache'))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], env=lmcache_env(), capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"
