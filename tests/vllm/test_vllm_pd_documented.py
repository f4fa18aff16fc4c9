"""docs/vllm.md's prefill/decode recipe, run with the page's own commands: the node of the first
session, a ``kv_producer`` and a ``kv_consumer`` OpenAI server of the CPU build, the proxy
(``examples/pd_proxy.py``), and a client's request to the proxy. As written but for the model
folder and the ports (free ones in place of 8080, 8081, 8100, 8200 and 8000), as in
``test_vllm_documented``.

Marked ``slow``: two engines start beside the node (some three minutes on two cores)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.servers import free_port, stop_group
from tests.vllm.conftest import VLLM_PYTHON
from tests.vllm.test_vllm_documented import (
    DOC,
    MODEL_DIR,
    Shell,
    answer,
    bash_blocks,
    block,
    environment,
    start,
    wait_for,
)

SECTION = "Prefill/decode disaggregation"
BLOCK = 32


def pd_block(*contains: str) -> str:
    (found,) = [b for b in bash_blocks(SECTION) if all(c in b for c in contains)]
    return found


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_documented_pd_recipe_loads_the_prefill_on_decode(
    smollm2: Path, tmp_path: Path
) -> None:
    ports = {p: free_port() for p in ("8080", "8100", "8200", "8000")}

    def as_here(commands: str) -> str:
        commands = commands.replace(MODEL_DIR, str(smollm2))
        for documented, port in ports.items():
            commands = commands.replace(f"127.0.0.1:{documented}", f"127.0.0.1:{port}")
            commands = commands.replace(f"--port {documented}", f"--port {port}")
        return commands

    vllm_env = environment(VLLM_PYTHON.parent)
    node_env = environment(Path(sys.executable).parent)
    node_env.update(SESSIONCACHE_PORT=str(ports["8080"]), SESSIONCACHE_STREAM_PORT="0")
    logs = {name: tmp_path / f"{name}.log" for name in ("node", "prefill", "decode", "proxy")}
    running = [start(as_here(block("sessioncache serve")), tmp_path, node_env, logs["node"])]
    shell = Shell(tmp_path, vllm_env)
    try:
        wait_for(f"http://127.0.0.1:{ports['8080']}/healthz", running[0], logs["node"], 60)
        for name, role, port in (
            ("prefill", "kv_producer", "8100"),
            ("decode", "kv_consumer", "8200"),
        ):
            server = start(
                as_here(pd_block(f'"kv_role": "{role}"')), tmp_path, vllm_env, logs[name]
            )
            running.append(server)
            # one engine start at a time: two cores
            wait_for(f"http://127.0.0.1:{ports[port]}/health", server, logs[name], 400)
        proxy = start(
            as_here(pd_block("examples.pd_proxy")), Path(DOC).parents[1], vllm_env, logs["proxy"]
        )
        running.append(proxy)
        wait_for(f"http://127.0.0.1:{ports['8000']}/health", proxy, logs["proxy"], 60)
        out = answer(shell.run(as_here(pd_block("/v1/chat/completions"))), logs["decode"])
        deadline = time.monotonic() + 60  # the decode's save (its finish) follows its answer
        while "sessioncache save:" not in logs["decode"].read_text():
            assert time.monotonic() < deadline, logs["decode"].read_text()[-5000:]
            time.sleep(0.2)
        session = httpx.get(
            f"http://127.0.0.1:{ports['8080']}/v1/sessions/agent-pd",
            headers={"Authorization": "Bearer sk-engines"},
            timeout=10,
        ).json()
    finally:
        shell.close()
        for process in reversed(running):
            stop_group(process)

    prompt = out["usage"]["prompt_tokens"]
    whole = prompt // BLOCK
    assert out["choices"][0]["message"]["content"] is not None, out
    prefill, decode = logs["prefill"].read_text(), logs["decode"].read_text()
    assert re.search(rf"sessioncache save: {whole} of {whole} blocks, .* from block 0", prefill)
    assert re.search(rf"sessioncache load: {whole} of {whole} blocks", decode), decode[-5000:]
    assert re.search(
        rf"sessioncache save: 0 of 0 blocks, .* from block {whole}, 0 held already, finish "
        r"(length|stop)",
        decode,
    ), decode[-5000:]
    assert session["attribution"]["hit_tokens"] >= whole * BLOCK, session  # the decode's lookup
    text = " ".join(DOC.read_text().split())
    assert f"`sessioncache save: {whole} of {whole} blocks`" in text, whole
    assert f"its {prompt} prompt tokens: {whole * BLOCK} loaded" in text, prompt
