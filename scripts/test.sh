#!/usr/bin/env bash
# Builds turboquant and runs every test: GoogleTest for the core (ctest), then pytest for the ops
# (CUDA tests run when a GPU and a CUDA build of torch are present, and are skipped, saying so,
# otherwise). Installs what it needs on a fresh machine with Python and pip.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
ensure_python_deps
ensure_gtest
# ON explicitly: demo.sh configures the same build directory with the tests off, and CMake keeps
# that in its cache, so after it a plain configure left the GoogleTest binary stale and ctest ran it.
build_turboquant -DTURBOQUANT_BUILD_TESTS=ON
echo "== C++ core tests"
ctest --test-dir "$BUILD_DIR" --output-on-failure --no-tests=error -j "$(nproc)"
echo "== Python op tests"
PYTHONPATH=python "$PYTHON" -m pytest tests/python -q -rs "$@"
