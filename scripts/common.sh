# Shared by scripts/test.sh and scripts/demo.sh: install what the build needs, then build.
# Sourced, not run. Honors PYTHON (default python3), BUILD_DIR (default build), CUDA_ARCHS.
PYTHON=${PYTHON:-python3}
BUILD_DIR=${BUILD_DIR:-build}

ensure_python_deps() {
  if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "== installing torch 2.13.0 (CPU build)"
    "$PYTHON" -m pip install -q torch==2.13.0
  fi
  local missing=()
  "$PYTHON" -c "import pytest" >/dev/null 2>&1 || missing+=(pytest)
  "$PYTHON" -c "import numpy" >/dev/null 2>&1 || missing+=(numpy)
  "$PYTHON" -c "import matplotlib" >/dev/null 2>&1 || missing+=(matplotlib)  # report plots
  command -v ninja >/dev/null 2>&1 || missing+=(ninja)
  command -v cmake >/dev/null 2>&1 || missing+=(cmake)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "== installing ${missing[*]}"
    "$PYTHON" -m pip install -q "${missing[@]}"
  fi
}

ensure_gtest() {
  if [ -f /usr/include/gtest/gtest.h ] || [ -f /usr/local/include/gtest/gtest.h ]; then return; fi
  echo "== installing GoogleTest (libgtest-dev)"
  if command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq libgtest-dev) >/dev/null
  else
    echo "turboquant: GoogleTest is missing and apt-get is unavailable; install libgtest-dev" >&2
    return 1
  fi
}

build_turboquant() {
  local extra=()
  if [ -n "${CUDA_ARCHS:-}" ]; then extra+=("-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS}"); fi
  cmake -S . -B "$BUILD_DIR" -G Ninja -DPython3_EXECUTABLE="$(command -v "$PYTHON")" "${extra[@]}" "$@" >/dev/null
  cmake --build "$BUILD_DIR" -j "$(nproc)"
}
