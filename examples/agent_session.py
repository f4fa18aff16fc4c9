"""An agent session that reuses its prefix across turns through sessioncache.

A small random-weight Llama (no download) plays an agent: a long system prompt, then a few
turns, each adding a user message and a short greedy reply. Every turn is prefilled twice:

* without the cache: the whole prompt through the model, as an engine with no prefix cache;
* with the cache: ``CachedPrefixRunner`` looks up the prompt's cached prefix, loads its KV
  blocks from the service and runs the model on the new suffix only.

Both must pick the same first token; the time to it (TTFT) is printed side by side. After the
reply, the turn's full blocks are stored for the next turn (and for any other engine).

Before each prefill the agent asks the service why the part of its prompt past the cached
prefix missed (``lookup(..., explain=True)``: ``LookupResult.miss``). The last turn writes a
timestamp into the system prompt, as agents often do: the whole cached history after it is
thrown away, and the answer says where (block, token offset) and how much (docs/prompt-
stability.md).

    python examples/agent_session.py                      # starts a throwaway local server
    python examples/agent_session.py --url http://127.0.0.1:8080 [--api-key KEY]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sessioncache.connector import Miss, SessionCacheClient
from sessioncache.connector.transfer import KVTransfer
from sessioncache.connector.transformers import CachedPrefixRunner, model_forward, namespace_for


@contextmanager
def local_server() -> Iterator[str]:
    """A ``sessioncache serve`` process on a free loopback port with a temporary data dir."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory(prefix="sessioncache-demo-") as tmp:
        log_path = Path(tmp) / "serve.log"
        env = {
            **os.environ,
            "SESSIONCACHE_CPU_BYTES": str(2 << 30),
            "SESSIONCACHE_DISK_BYTES": str(4 << 30),
            "SESSIONCACHE_STREAM_PORT": "0",  # a free port: the demo does not use the stream
        }
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "sessioncache.cli", "serve", "--port", str(port),
                 "--data-dir", str(Path(tmp) / "data")],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"the server exited:\n{log_path.read_text()}")
                try:
                    if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start:\n{log_path.read_text()}")
                time.sleep(0.1)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=8192,
    )
    model = LlamaForCausalLM(config)  # float32, torch's default dtype
    model.eval()  # type: ignore[no-untyped-call]
    return model


def run(url: str, args: argparse.Namespace) -> None:
    model = build_model(args)
    ns = namespace_for(
        model, block_tokens=args.block_tokens, model_id=f"demo/random-llama-seed{args.seed}"
    )
    gen = torch.Generator().manual_seed(args.seed + 1)

    def message(n: int) -> list[int]:
        return [int(t) for t in torch.randint(0, args.vocab, (n,), generator=gen)]

    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model: random Llama, {args.layers} layers, hidden {args.hidden}, {params:.0f}M params")
    print(f"server: {url}  namespace: {ns.model} / {ns.kv_layout} / {ns.block_tokens} tok\n")
    model_forward(model, torch.tensor([message(64)]))  # warm up the kernels

    with (
        SessionCacheClient(url, namespace=ns, api_key=args.api_key) as client,
        KVTransfer(client, path=args.path) as transfer,
    ):
        runner = CachedPrefixRunner(model, client, transfer=transfer)
        used = transfer.path
        print(f"data path: {used} (--path auto tries same_host, stream, rest)\n")
        session = client.open_session(kind="agent")
        history = message(args.system_tokens)  # system prompt + tool schemas
        header = (
            f"{'turn':>4} {'prompt':>7} {'reused':>7} | {'TTFT no cache':>13} "
            f"{'TTFT cached':>11} {'speedup':>7} | {'load':>7} {'GB/s':>5} {'compute':>8}"
        )
        print(header)
        print("-" * len(header))
        why: list[str] = []
        for turn in range(1, args.turns + 2):
            if turn > args.turns:  # a timestamp written into the system prompt
                history = list(history)
                at = args.system_tokens // 3
                history[at : at + 4] = message(4)
            prompt = history + message(args.user_tokens)
            miss = client.lookup(prompt, session_id=session.id, explain=True).miss
            why.append(describe(turn, miss))

            ttft_plain = ttft_cached = float("inf")
            for _ in range(args.repeat):  # the best of a few: the machine may be busy
                t0 = time.perf_counter()
                logits, _ = model_forward(model, torch.tensor([prompt]), last_logits_only=True)
                first_plain = int(logits[0, -1].argmax())
                ttft_plain = min(ttft_plain, time.perf_counter() - t0)

                t0 = time.perf_counter()
                pre = runner.prefill(prompt, session_id=session.id, last_logits_only=True)
                first = int(pre.logits[0, -1].argmax())
                ttft_cached = min(ttft_cached, time.perf_counter() - t0)
            if first != first_plain:
                raise SystemExit(f"turn {turn}: first tokens differ: {first} vs {first_plain}")

            reply = [first]
            for _ in range(args.reply_tokens - 1):
                reply.append(int(runner.step(reply[-1], pre.cache).argmax()))
            history = prompt + reply
            runner.save(history[:-1], pre.cache, session_id=session.id)  # KV of all but the last

            ms = {k: f"{v * 1e3:6.1f}ms" for k, v in pre.timings.items()}
            moved = runner.last_load
            gbps = f"{moved.gbps:5.2f}" if moved is not None and moved.blocks else "    -"
            print(
                f"{turn:>4} {len(prompt):>7} {pre.cached_tokens:>7} | "
                f"{ttft_plain * 1e3:11.1f}ms {ttft_cached * 1e3:9.1f}ms "
                f"{ttft_plain / ttft_cached:6.1f}x | "
                f"{ms['load']:>7} {gbps} {ms['compute']:>8}"
            )
        totals = client.get_session(session.id).attribution
        client.close_session(session.id)
    print("\nwhy the uncached part of each prompt missed (lookup explain=True):")
    print("\n".join(why))
    if totals is not None:
        missed = ", ".join(f"{k} {v}" for k, v in totals.miss_tokens.items() if v)
        print(
            f"session: {totals.lookups} lookups, {totals.hit_tokens} tokens hit; missed: "
            f"{missed}; last divergence (block, offset, token): {totals.last_divergence}"
        )
    print(
        f"\nTTFT: best of {args.repeat}; load (lookup included) / GB/s / compute: the last cached "
        f"prefill, over the {used} path. The first token of every turn is the same "
        "with and without the cache."
    )


def describe(turn: int, miss: Miss | None) -> str:
    """One line on why a turn's lookup missed what it missed."""
    if miss is None or miss.reason is None:
        return f"{turn:>4}  nothing missed"
    where = f"block {miss.block} (token {miss.token}"
    where += f", offset {miss.offset} in the block)" if miss.offset is not None else ")"
    detail = {
        "diverged": "the prompt differs from the session's previous one there",
        "evicted": f"evicted from {miss.tier} {miss.ago_s or 0:.0f}s ago ({miss.pressure})",
        "expired": f"its TTL ran out {miss.ago_s or 0:.0f}s ago",
        "new": "never seen: the conversation grew",
    }[miss.reason]
    counts = ", ".join(f"{k} {v}" for k, v in miss.tokens.items() if v)
    return f"{turn:>4}  {miss.reason} at {where}: {detail}; missed tokens: {counts}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running sessioncache (default: start a local one)")
    parser.add_argument("--api-key", help="API key, when the server has auth on")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--user-tokens", type=int, default=96)
    parser.add_argument("--reply-tokens", type=int, default=16)
    parser.add_argument("--block-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512, help="a multiple of 128")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="report the best of N prefills")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--path", default="auto", choices=["auto", "same_host", "stream", "rest"],
        help="the data path for KV payloads (auto: the fastest the node offers)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.url:
        run(args.url, args)
    else:
        with local_server() as url:
            run(url, args)


if __name__ == "__main__":
    main()
