"""One vLLM engine process for the connector's tests (run with the vLLM environment's Python):
generates greedily for the prompts of a JSON spec and prints one JSON line per prompt."""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = None
    if spec.get("connector") == "sessioncache":
        transfer = KVTransferConfig(
            kv_connector="SessionCacheConnector",
            kv_connector_module_path="sessioncache.connector.vllm",
            kv_role=spec.get("role", "kv_both"),
            kv_connector_extra_config=spec["extra"],
            kv_load_failure_policy="recompute",
        )
    elif spec.get("connector") == "example":
        transfer = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": spec["path"]},
        )
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        load_format=spec.get("load_format", "dummy"),
        block_size=spec.get("block_size", 32),
        max_model_len=spec.get("max_model_len", 4096),
        enable_prefix_caching=spec.get("prefix_caching", True),
        kv_transfer_config=transfer,
        seed=0,
        enforce_eager=True,
        dtype=spec.get("dtype", "bfloat16"),
        **spec.get("llm", {}),  # e.g. mamba_cache_mode for a hybrid model
    )
    for prompt in spec["prompts"]:
        if prompt.get("gate"):  # the test does something to the node, then opens the gate
            print("GATE", flush=True)
            while not os.path.exists(prompt["gate"]):
                time.sleep(0.05)
        params = SamplingParams(
            temperature=0.0,
            max_tokens=prompt.get("max_tokens", spec.get("max_tokens", 8)),
            logprobs=1,
            extra_args={"kv_transfer_params": prompt["params"]} if prompt.get("params") else None,
        )
        tokens = TokensPrompt(prompt_token_ids=prompt["tokens"])
        if prompt.get("cache_salt"):
            tokens["cache_salt"] = prompt["cache_salt"]
        (out,) = llm.generate([tokens], params)
        sample = out.outputs[0]
        steps = sample.logprobs or []
        logprobs = [
            steps[i][token].logprob for i, token in enumerate(sample.token_ids[: len(steps)])
        ]
        print(
            "RESULT "
            + json.dumps(
                {
                    "tokens": list(sample.token_ids),
                    "cached": out.num_cached_tokens,
                    "logprobs": logprobs,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
