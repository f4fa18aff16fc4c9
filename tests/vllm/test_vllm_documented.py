"""docs/vllm.md's first session, run with the page's own commands (its fenced bash blocks, read
from the page and chosen by what they run): the model folder, the node with an API key, the CPU
build's OpenAI server with the connector, two turns of one session, and the session read back
from the node with the tenant's key.

They run as written but for:
- the model folder: ``~/models/smollm2`` is the ``smollm2`` fixture's folder (made once per
  test run by the same module); the page's ``pip install`` line is not run (no network): the
  fixture skips where the package is missing;
- the ports: free ones in place of the node's 8080 (``SESSIONCACHE_PORT``) and 8081
  (``SESSIONCACHE_STREAM_PORT=0``: the connector asks the node where its stream is), and of
  vLLM's 8000 (``--port``, and in the URLs), so that the test never meets another node;
- ``PATH`` and ``PYTHONPATH``: ``sessioncache`` is the test environment's, ``python`` the vLLM
  environment's (``.venv-vllm``).

The two turns and the read run in one shell (the second turn uses the first's ``$SYSTEM``). A
reader types the second turn seconds after the first; here it waits until the first turn's
save has set the session's head."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.servers import free_port, stop_group
from tests.vllm.conftest import ROOT_DIR, VLLM_PYTHON

DOC = ROOT_DIR / "docs" / "vllm.md"
MODEL_DIR = "~/models/smollm2"
ENTRYPOINT = "vllm.entrypoints.openai.api_server"
BLOCK = 32
SESSION = "agent-42"
KEY = "sk-engines"


def section(title: str) -> str:
    """The page's section whose heading starts with ``title``, to the next heading."""
    text = DOC.read_text()
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def bash_blocks(title: str = "A first session") -> list[str]:
    return re.findall(r"```bash\n(.*?)```", section(title), re.S)


def block(*contains: str) -> str:
    """The page's one bash block that contains all of ``contains``."""
    (found,) = [b for b in bash_blocks() if all(c in b for c in contains)]
    return found


def turns() -> list[str]:
    found = [b for b in bash_blocks() if "/v1/chat/completions" in b]
    assert len(found) == 2, found
    return found


def test_the_documented_commands_agree() -> None:
    """The page's blocks name one node, one engine, one key and one session."""
    node = block("sessioncache serve")
    assert f'SESSIONCACHE_API_KEYS=\'{{"{KEY}": "agents"}}\'' in node
    engine = block(ENTRYPOINT)
    assert engine.startswith("VLLM_CPU_KVCACHE_SPACE=")
    (space,) = re.findall(r"VLLM_CPU_KVCACHE_SPACE=(\d+)", engine)
    assert 1 <= int(space) <= 2  # beside the node on a small host
    assert f"--model {MODEL_DIR}" in engine and "--port" not in engine  # vLLM's 8000
    assert f'"url": "http://127.0.0.1:8080", "api_key": "{KEY}"' in engine
    assert f"python -m bench.engines.smollm2 {MODEL_DIR}" in block("bench.engines.smollm2")
    for turn in turns():
        assert "http://127.0.0.1:8000/v1/chat/completions" in turn
        assert f'"session_id": "{SESSION}"' in turn
    read = block(f"/v1/sessions/{SESSION}")
    assert f"Bearer {KEY}" in read and "http://127.0.0.1:8080/" in read


class Shell:
    """One bash process that runs blocks one after another, as pasted into one terminal."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            ["bash"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )

    def run(self, commands: str) -> str:
        """What the commands printed."""
        assert self.process.stdin is not None and self.process.stdout is not None
        marker = f"::done {uuid.uuid4().hex}"
        self.process.stdin.write(f"{commands}\nprintf '\\n%s\\n' '{marker}'\n")
        self.process.stdin.flush()
        lines = []
        while (line := self.process.stdout.readline()) and line.rstrip("\n") != marker:
            lines.append(line)
        assert line, f"the shell ended: {''.join(lines)}"
        return "".join(lines)

    def close(self) -> None:
        stop_group(self.process)


def start(commands: str, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """A block that keeps running (a server), in a process group of its own."""
    with log.open("wb") as out:
        return subprocess.Popen(
            ["bash", "-c", commands],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_for(url: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, log.read_text()[-5000:]
        assert time.monotonic() < deadline, f"{url} did not answer: {log.read_text()[-5000:]}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def answer(printed: str, log: Path) -> dict[str, Any]:
    """The JSON a documented curl printed (else what it printed, and the server's log)."""
    try:
        found = json.loads(printed)
    except ValueError:
        found = None
    assert isinstance(found, dict), f"{printed[-3000:]}\n{log.read_text()[-5000:]}"
    return found


def environment(bin_dir: Path) -> dict[str, str]:
    """The test's environment without the node's settings, ``bin_dir`` first on ``PATH``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONCACHE_")}
    env.update(PATH=os.pathsep.join([str(bin_dir), env.get("PATH", "")]), PYTHONPATH=str(ROOT_DIR))
    return env


@pytest.mark.timeout(420)
def test_the_documented_session_hits_on_the_node(smollm2: Path, tmp_path: Path) -> None:
    node_port, vllm_port = free_port(), free_port()

    def as_here(commands: str) -> str:
        return (
            commands.replace(MODEL_DIR, str(smollm2))
            .replace("127.0.0.1:8080", f"127.0.0.1:{node_port}")
            .replace("127.0.0.1:8000", f"127.0.0.1:{vllm_port}")
            .replace(ENTRYPOINT, f"{ENTRYPOINT} --port {vllm_port}")
        )

    vllm_env = environment(VLLM_PYTHON.parent)
    # 1. The model folder (the fixture made it: the documented command finds it made).
    model = [
        line for line in block("bench.engines.smollm2").splitlines() if not line.startswith("pip ")
    ]
    made = subprocess.run(
        ["bash", "-c", as_here("\n".join(model))],
        cwd=ROOT_DIR,  # "from the repository root"
        env=vllm_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0 and str(smollm2) in made.stdout, made.stdout + made.stderr

    # 2. The node, in an empty directory (its data goes there); 3. the engine.
    node_env = environment(Path(sys.executable).parent)
    node_env.update(SESSIONCACHE_PORT=str(node_port), SESSIONCACHE_STREAM_PORT="0")
    node_log, vllm_log = tmp_path / "node.log", tmp_path / "vllm.log"
    node = start(as_here(block("sessioncache serve")), tmp_path, node_env, node_log)
    engine = None
    shell = Shell(tmp_path, vllm_env)
    headers = {"Authorization": f"Bearer {KEY}"}
    session_url = f"http://127.0.0.1:{node_port}/v1/sessions/{SESSION}"
    try:
        wait_for(f"http://127.0.0.1:{node_port}/healthz", node, node_log, 60)
        engine_block = as_here(block(ENTRYPOINT))
        engine = start(engine_block, tmp_path, vllm_env, vllm_log)
        wait_for(f"http://127.0.0.1:{vllm_port}/health", engine, vllm_log, 300)

        # 4. Two turns of one session.
        first_turn, second_turn = turns()
        first = answer(shell.run(as_here(first_turn)), vllm_log)
        prompt = first["usage"]["prompt_tokens"]
        deadline = time.monotonic() + 60  # the turn's save runs after its request finished
        while httpx.get(session_url, headers=headers, timeout=10).json().get("head") is None:
            assert time.monotonic() < deadline, f"not saved: {vllm_log.read_text()[-5000:]}"
            time.sleep(0.2)
        second = answer(shell.run(as_here(second_turn)), vllm_log)
        assert second["usage"]["prompt_tokens"] > prompt, (first, second)
        deadline = time.monotonic() + 60  # its save, with its finish, follows the answer
        while httpx.get(session_url, headers=headers, timeout=10).json()["last_finish"] is None:
            assert time.monotonic() < deadline, f"no finish: {vllm_log.read_text()[-5000:]}"
            time.sleep(0.2)

        # 5. The session, read with the tenant's key.
        info = answer(shell.run(as_here(block(f"/v1/sessions/{SESSION}"))), node_log)
    finally:
        shell.close()
        if engine is not None:
            stop_group(engine)
        stop_group(node)

    whole = prompt // BLOCK * BLOCK
    assert whole >= 8 * BLOCK, prompt  # a prompt of several blocks, or nothing to see
    assert info["tenant"] == "agents", info
    assert info["head"] is not None and info["pinned"], info  # the engine's saves
    assert info["attribution"]["lookups"] == 2, info
    assert info["attribution"]["hit_tokens"] >= whole, info  # the first turn's whole blocks
    assert info["last_finish"] == "tool", info  # the agent's word, through the connector
    # The page's figures for its prompts are these ones.
    text = " ".join(DOC.read_text().split())
    assert f"Its {prompt} prompt tokens" in text, prompt
    assert f"first turn's {prompt // BLOCK} whole blocks" in text, prompt
    assert f"`attribution.hit_tokens` is {info['attribution']['hit_tokens']}:" in text, info
    log = vllm_log.read_text()
    assert "sessioncache: loads over stream" in log, log[-5000:]
    assert re.search(r"sessioncache save: [1-9]\d* of .*, finish tool_use", log), log[-5000:]
