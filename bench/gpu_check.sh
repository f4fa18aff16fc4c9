#!/usr/bin/env bash
# The prepared device check (bench/gpu_check.py) on a bare GPU machine: Python 3.12 with torch,
# transformers, numpy, httpx, xxhash and pytest, nothing fetched. The node's other dependencies
# travel as wheels in .gpu-wheels/ (bench/gpu_wheels.sh makes it; carry it to the machine),
# installed here into a folder of their own. The JSON report goes to $OUT (the device tool's
# folder) or the current directory. Arguments go to the script (--cpu: the dry run).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$python" -c "import sessioncache.api.app, sessioncache.commands.serve" 2>/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/sessioncache-site .gpu-wheels/*.whl
  export PYTHONPATH="/tmp/sessioncache-site:$PYTHONPATH"
fi
export PYTHONUNBUFFERED=1
exec "$python" -m bench.gpu_check --out "${OUT:-.}/gpu_check.json" "$@"
