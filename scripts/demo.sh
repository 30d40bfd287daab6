#!/usr/bin/env bash
# The main job: builds turboquant, installs the real model and text, and prints the real-model report
# (python -m turboquant.demo: generated text, KV bytes, tokens/s and perplexity per preset).
# Runs on the CPU; uses the GPU when there is one. Arguments go to the demo (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
ensure_python_deps
ensure_real_model_deps
build_turboquant -DTURBOQUANT_BUILD_TESTS=OFF
PYTHONPATH=python "$PYTHON" -m turboquant.demo "$@"
