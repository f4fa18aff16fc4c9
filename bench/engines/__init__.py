"""Scripts ``bench.vllm`` runs in the vLLM environment (``.venv-vllm``)."""
