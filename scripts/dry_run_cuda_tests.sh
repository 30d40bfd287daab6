#!/usr/bin/env bash
# For machines without a GPU: runs the CUDA tests' own code on the CPU (tests/python/cuda_dry_run.py
# maps every "cuda" device to the CPU; graph, stream and forced-kernel tests are left out), so a
# broken test shows here and not in the GPU machine's limited time. No kernel runs: this is not a
# CUDA test run and its passes are not CUDA passes. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
ensure_python_deps
build_turboquant
echo "== DRY RUN of the CUDA tests on the CPU (no kernel runs)"
parallel=()
if "$PYTHON" -c "import xdist" 2>/dev/null; then parallel=(-n "$(nproc)"); fi
PYTHONPATH="python:tests/python" "$PYTHON" -m pytest -p cuda_dry_run -p no:cacheprovider tests/python -q \
  "${parallel[@]}" "$@"
