#!/usr/bin/env bash
# Download what bench/gpu_check.sh installs on a bare GPU machine that cannot fetch anything:
# CPython 3.12 manylinux x86_64 wheels of the node's dependencies that such a machine lacks
# (it has torch, transformers, numpy, httpx, xxhash, pytest), into .gpu-wheels/ (git-ignored).
# Versions are those of this checkout's tested environment. Run it here, where PyPI is reached.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.gpu-wheels
rm -rf "$dest" && mkdir -p "$dest"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$dest" -r bench/gpu_requirements.txt
ls "$dest"
du -sh "$dest"
