#!/usr/bin/env bash
# The main job: builds turboquant and prints the preset report (python -m turboquant.demo).
# Runs on the CPU; uses the GPU when there is one. Arguments go to the demo (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
ensure_python_deps
build_turboquant -DTURBOQUANT_BUILD_TESTS=OFF
PYTHONPATH=python "$PYTHON" -m turboquant.demo "$@"
