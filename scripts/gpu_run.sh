#!/usr/bin/env bash
# One call on the GPU machine: build for sm_90, run every test (CUDA included), the benchmarks,
# and print a short table last. Logs and tables go to $OUT (or ./gpu_out).
#   bash scripts/gpu_run.sh [tests|bench|speed|profile|all] [pytest -k expression]
# A cold H200 call costs ~2 minutes of device time before the command starts: do it all in one.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
what=${1:-all}
export CUDA_ARCHS=90 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
source scripts/common.sh
ensure_python_deps
start=$(date +%s)
build_turboquant > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
echo "== built in $(( $(date +%s) - start )) s"
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  ctest --test-dir "$BUILD_DIR" -j 8 2>&1 | tail -3
  PYTHONPATH=python timeout 420 "$PYTHON" -m pytest tests/python -q -rs -n 12 ${2:+-k "$2"} > "$OUT/pytest.log" 2>&1 || status=1
  tail -15 "$OUT/pytest.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  rm -f "$OUT/results.md"
  timeout 200 "$PYTHON" benchmarks/bench_store.py --out "$OUT/results.md" > "$OUT/bench_store.log" 2>&1 || { status=1; tail -20 "$OUT/bench_store.log"; }
  timeout 300 "$PYTHON" benchmarks/bench_decode.py --out "$OUT/results.md" > "$OUT/bench_decode.log" 2>&1 || { status=1; tail -20 "$OUT/bench_decode.log"; }
  echo; cat "$OUT/results.md"
fi
if [ "$what" = speed ]; then  # context/batch sweep, plots and section in benchmarks/RESULTS.md
  cp benchmarks/RESULTS.md "$OUT/RESULTS.md"  # comes back updated: copy it over the repo's
  timeout 500 "$PYTHON" benchmarks/speed.py --out "$OUT/RESULTS.md" > "$OUT/speed.log" 2>&1 || status=1
  tail -40 "$OUT/RESULTS.md"
fi
if [ "$what" = profile ]; then
  timeout 200 ncu --clock-control none --kernel-name regex:decode_kernel --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section SchedulerStats \
    "$PYTHON" benchmarks/profile_decode.py > "$OUT/ncu.txt" 2>&1 || status=1
  grep -E "^    (Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Issued Warp|No Eligible|Warp Cycles Per Issued)" "$OUT/ncu.txt"
fi
exit $status
