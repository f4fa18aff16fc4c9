"""One vLLM engine for ``bench.vllm`` (run with the vLLM environment's Python): a warm-up
prompt, then each prompt of the JSON spec with one output token (``params``: each prompt's
``kv_transfer_params``, or none); prints per prompt its seconds (the time to the first token,
offline) and vLLM's cached prompt tokens."""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = None
    if spec.get("url"):
        transfer = KVTransferConfig(
            kv_connector="SessionCacheConnector",
            kv_connector_module_path="sessioncache.connector.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"url": spec["url"], **spec.get("extra", {})},
            kv_load_failure_policy="recompute",
        )
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        block_size=spec["block_size"],
        max_model_len=8192,
        enable_prefix_caching=True,
        kv_transfer_config=transfer,
        enforce_eager=True,
        seed=0,
        dtype="bfloat16",
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([TokensPrompt(prompt_token_ids=spec["warmup"])], params, use_tqdm=False)
    given = spec.get("params") or [None] * len(spec["prompts"])
    for tokens, kv_params in zip(spec["prompts"], given, strict=True):
        extra = {"kv_transfer_params": kv_params} if kv_params else None
        params = SamplingParams(temperature=0.0, max_tokens=1, extra_args=extra)
        start = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        print(
            "RESULT "
            + json.dumps(
                {
                    "seconds": seconds,
                    "cached": out.num_cached_tokens,
                    "token": out.outputs[0].token_ids[0],
                }
            ),
            flush=True,
        )
    time.sleep(spec.get("linger_s", 0))  # lets the last saves finish before the engine ends


if __name__ == "__main__":
    main()
