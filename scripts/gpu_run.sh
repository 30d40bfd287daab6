#!/usr/bin/env bash
# One call on the GPU machine: build for sm_90 (CUDA_ARCHS=90), run the steps asked for, print short tables.
# Tables go to $OUT (default ./gpu_out); logs are packed into $OUT/logs.tgz at the end.
#   bash scripts/gpu_run.sh [steps...]      (no step, or `all`: tests bench)
#
# | step            | what it runs                                              | knobs (environment)                      |
# |-----------------|-----------------------------------------------------------|------------------------------------------|
# | tests           | GoogleTest + pytest, CUDA tests included                  | TESTS, TESTS_K (-k), TESTS_TIMEOUT (520) |
# | sanitize        | compute-sanitizer memcheck/racecheck/synccheck on a test subset, both decode kernels and the attention options | SANITIZE_TIMEOUT (420) |
# | race_control    | racecheck on tools/probes/ring_racecheck_probe.cu alone   |                                          |
# | bench           | benchmarks/bench_store.py + bench_decode.py (RESULTS.md tables) |                                    |
# | generate        | benchmarks/bench_generate.py: transformers' generate, TurboQuantCache vs default cache | GENERATE_ARGS, GENERATE_TIMEOUT (300) |
# | options         | benchmarks/bench_options.py: windowed decode vs plain over the window; softcap, sinks |       |
# | transforms      | benchmarks/bench_transforms.py: decode and store with the per-head transforms vs without |     |
# | head_dims       | benchmarks/bench_head_dims.py: the generic kernels (D = 96, 160) and the tiled ones (128) vs SDPA |  |
# | short           | bench_decode.py, short contexts (4bit_nc, k8v4)           |                                          |
# | serving         | benchmarks/bench_serving.py: a serving engine's block tables | SERVING_ARGS, SERVING_TIMEOUT (300)   |
# | continuation    | benchmarks/bench_continuation.py, both varlen kernels     |                                          |
# | speed           | benchmarks/speed.py: context/batch sweep, plots, RESULTS section | COMMIT (names the commit)         |
# | splits          | benchmarks/sweep_splits.py: decode time vs split count    | SPLITS_TABLE_TOKENS                      |
# | splits_short    | the same at short contexts                                | SPLITS_TABLE_TOKENS                      |
# | breakdown       | benchmarks/decode_breakdown.py: kernel vs merge vs step   | BREAKDOWN_ARGS (--placement)             |
# | diagnose        | benchmarks/diagnose_decode.py: one input knob at a time   |                                          |
# | profile         | ncu stall samples of the default decode kernel            | DECODE_SHAPE ("32 32 8 8192"; ";" separates shapes), NCU_ARGS |
# | profile_kernels | ncu of both plain-decode kernels, forced, on each shape   | DECODE_SHAPE ("1 32 8 32768"), PROFILE_ARGS, NCU_ARGS |
# | profile_store   | ncu of the store kernel                                   | NCU_ARGS                                 |
# | profile_varlen  | ncu of the chunked varlen kernel (16- and 128-token chunks) | NCU_ARGS                               |
# | probe           | tools/probes/paged_read_probe.cu (reads only)             |                                          |
# | cta_placement   | tools/probes/cta_placement_probe.cu                       |                                          |
#
# A cold machine costs a minute or two before the command starts: ask for every step in one call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
steps="${*:-all}"
steps="${steps/all/tests bench}"
export CUDA_ARCHS=90 PYTHONUNBUFFERED=1
export TURBOQUANT_REQUIRE_CUDA=1  # pytest fails, not skips, if the CUDA ops did not build (tests/python/conftest.py)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
source scripts/common.sh
ensure_python_deps
# SM clock, power and temperature every 200 ms for the whole call, with the step that ran
# (mark_step): a step timed slower than another run of the same kernels shows whether the card's
# clocks differed (summarized at the end, per step).
clock_fields=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active
nvidia-smi --query-gpu=$clock_fields --format=csv >/dev/null 2>&1 || clock_fields=${clock_fields/event/throttle}  # older drivers
# Started from a subshell, so it is not this shell's child: the `wait`s below (for the probe
# builds and the sanitizer runs) would otherwise wait for it forever.
clock_logger=$(nvidia-smi --query-gpu=$clock_fields --format=csv,noheader,nounits -lms 200 > "$OUT/clocks.csv" 2>/dev/null &
  echo $!)
mark_step() { echo "$(date '+%Y/%m/%d %H:%M:%S.%3N') $1" >> "$OUT/steps.txt"; }
mark_step build
has() { [[ " $steps " == *" $1 "* ]]; }
start=$(date +%s)
if has probe; then  # standalone, no torch: compile it while the library builds
  nvcc -O3 -std=c++17 -arch=sm_90 tools/probes/paged_read_probe.cu -o "$OUT/probe.bin" > "$OUT/probe_build.log" 2>&1 &
fi
build_turboquant -DTURBOQUANT_BUILD_TESTS=ON > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
wait
echo "== built in $(( $(date +%s) - start )) s"
status=0
if has probe; then
  echo "== paged read probe (data movement only)"; timeout 120 "$OUT/probe.bin" | tee "$OUT/probe.md" || status=1
fi
if has cta_placement; then  # standalone: where a grid's CTAs land, and what CTAs without work cost the busy ones
  mark_step cta_placement
  nvcc -O3 -std=c++17 -arch=sm_90 tools/probes/cta_placement_probe.cu -o "$OUT/cta_probe.bin" > "$OUT/cta_probe_build.log" 2>&1 \
    && echo "== CTA placement probe" && timeout 120 "$OUT/cta_probe.bin" | tee "$OUT/cta_placement.md" \
    || { status=1; tail -20 "$OUT/cta_probe_build.log"; }
fi
if has diagnose; then
  mark_step diagnose
  echo "== decode knobs"; timeout 240 "$PYTHON" benchmarks/diagnose_decode.py 2>&1 | tee "$OUT/diagnose.md" || status=1
fi
if has splits; then  # decode time against the split count at batch 1..16 (the split rule's evidence)
  mark_step splits
  echo "== decode vs splits"; PYTHONPATH=python timeout 300 "$PYTHON" benchmarks/sweep_splits.py --out "$OUT/splits.md" || status=1
  if [ -n "${SPLITS_TABLE_TOKENS:-}" ]; then  # again with a serving engine's block tables: auto vs a forced count
    echo "== decode vs splits, block tables of $SPLITS_TABLE_TOKENS tokens"
    PYTHONPATH=python timeout 300 "$PYTHON" benchmarks/sweep_splits.py --table-tokens "$SPLITS_TABLE_TOKENS" \
      --out "$OUT/splits.md" || status=1
  fi
fi
if has sanitize || has race_control; then  # a standalone control: can racecheck see the row kernel's mbarrier ring at all?
  nvcc -O3 -std=c++17 -arch=sm_90 -Ikernels -Iinclude tools/probes/ring_racecheck_probe.cu -o "$OUT/ring_probe.bin" \
    > "$OUT/ring_probe_build.log" 2>&1 &
fi
if has sanitize; then  # correctness only: the three tools run side by side, exact-size allocations
  mark_step sanitize
  sanitize() {  # sanitize <log name> <tool> <-k expression> <test files...>
    local name=$1 tool=$2 k=$3; shift 3
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONPATH=python timeout "${SANITIZE_TIMEOUT:-420}" compute-sanitizer --tool "$tool" \
      --error-exitcode 9 --print-limit 30 "$PYTHON" -m pytest "$@" -q -p no:cacheprovider \
      -k "$k" > "$OUT/sanitize_$name.log" 2>&1
    echo "$name exit=$?" >> "$OUT/sanitize_$name.log"
  }
  files="tests/python/test_cuda.py tests/python/test_varlen.py"
  small="(decode_matches_cpu and 128 and not 16) or (store_matches_cpu_bytes and bfloat16) or dequantize or masked or (varlen and not graph)"
  # graph capture is left out: without the caching allocator it would cudaMalloc while capturing
  sanitize memcheck memcheck "out_of_range_indices or $small or edge_values or (serving_block_tables and not own_row_splits)" $files &
  sanitize racecheck racecheck "$small" $files &
  sanitize synccheck synccheck "$small" $files &
  # The row-staged decode kernel, forced: its bulk copies, mbarriers and shared ring (subprocess
  # reruns and graph capture left out).
  rows="not each_decode_kernel and not refuses and not graph and ((matches_cpu and not 7 and not 3) or several or masks or past or serving)"
  TURBOQUANT_DECODE_KERNEL=rows sanitize rows_memcheck memcheck "$rows" tests/python/test_decode_rows.py &
  TURBOQUANT_DECODE_KERNEL=rows sanitize rows_racecheck racecheck "$rows and not dtypes" tests/python/test_decode_rows.py &
  # The attention options (windows, soft-capping, sinks) on the per-head kernel: its windowed range,
  # the sink in split 0's epilogue, both merges.
  sanitize options_memcheck memcheck "cuda and not graph and not refuses" tests/python/test_attention_options.py &
  sanitize options_racecheck racecheck "cuda_decode_options and 4bit" tests/python/test_attention_options.py &
  # The generic kernels (head dims without tiles): their shared-memory vectors and warp transforms.
  sanitize generic_memcheck memcheck "(96 or 160 or 8-) and not graph" tests/python/test_cuda_head_dims.py &
  sanitize generic_racecheck racecheck "(store or decode_matches) and (96 or 160)" tests/python/test_cuda_head_dims.py &
  # The per-head transforms each kernel reads (key_scale where it stages the query, value_offset where
  # it writes the output; the store's three vectors).
  sanitize transforms_memcheck memcheck "each_cuda_kernel or ((store_writes or any_offset) and cuda)" \
    tests/python/test_kv_transforms.py &
fi
if has tests; then
  mark_step tests
  # Kept in $OUT too: a long pytest log pushes the verdict out of the returned tail.
  ctest --test-dir "$BUILD_DIR" --no-tests=error -j 8 > "$OUT/ctest.log" 2>&1 || status=1
  tail -3 "$OUT/ctest.log"
  PYTHONPATH=python timeout "${TESTS_TIMEOUT:-520}" "$PYTHON" -m pytest ${TESTS:-tests/python} -v -rfs -n 12 --durations=12 ${TESTS_K:+-k "$TESTS_K"} > "$OUT/pytest.log" 2>&1 || status=1
  # -v names every result as it comes, so a run cut short by the time limit still names its
  # failures (with -q one cut-off run showed an F and no name).
  grep -E "(FAILED|ERROR) tests/" "$OUT/pytest.log" | head -20
  grep -A14 "slowest .*durations" "$OUT/pytest.log" | grep -E "^[0-9.]+s " | head -6  # what bounds the next call's test time
  tail -3 "$OUT/pytest.log"
fi
if has sanitize || has race_control; then
  wait
  # racecheck's verdict on the control (tools/probes/ring_racecheck_probe.cu)
  timeout 60 compute-sanitizer --tool racecheck "$OUT/ring_probe.bin" > "$OUT/ring_racecheck.log" 2>&1
  echo "== racecheck control (exit $?): $(grep -E '^ring' "$OUT/ring_racecheck.log") | $(grep -E 'RACECHECK SUMMARY' "$OUT/ring_racecheck.log" | tail -1)"
fi
if has sanitize; then
  for t in memcheck racecheck synccheck rows_memcheck rows_racecheck options_memcheck options_racecheck generic_memcheck \
    generic_racecheck transforms_memcheck; do
    echo "== compute-sanitizer $t: $(grep -E 'ERROR SUMMARY' "$OUT/sanitize_$t.log" | tail -1) | $(grep -E 'passed|failed' "$OUT/sanitize_$t.log" | tail -1) | $(tail -1 "$OUT/sanitize_$t.log")"
    grep -q "exit=0" "$OUT/sanitize_$t.log" || status=1
  done
fi
if has bench; then
  mark_step bench
  rm -f "$OUT/results.md"
  timeout 200 "$PYTHON" benchmarks/bench_store.py --out "$OUT/results.md" > "$OUT/bench_store.log" 2>&1 || { status=1; tail -20 "$OUT/bench_store.log"; }
  timeout 300 "$PYTHON" benchmarks/bench_decode.py --out "$OUT/results.md" > "$OUT/bench_decode.log" 2>&1 || { status=1; tail -20 "$OUT/bench_decode.log"; }
  echo; cat "$OUT/results.md"
fi
if has generate; then  # end to end through transformers (random Llama-3-8B-shaped model)
  mark_step generate
  echo "== generate (transformers)"
  PYTHONPATH=python timeout "${GENERATE_TIMEOUT:-300}" "$PYTHON" benchmarks/bench_generate.py ${GENERATE_ARGS:-} \
    --out "$OUT/generate.md" > "$OUT/generate.log" 2>&1 || { status=1; tail -20 "$OUT/generate.log"; }
  grep -E "^\|" "$OUT/generate.md"
fi
if has options; then  # sliding window vs a plain decode over the window; softcap and sinks vs plain
  mark_step options
  timeout 300 "$PYTHON" benchmarks/bench_options.py --out "$OUT/options.md" > "$OUT/bench_options.log" 2>&1 \
    || { status=1; tail -20 "$OUT/bench_options.log"; }
  cat "$OUT/options.md"
fi
if has transforms; then  # the ops' per-head transforms: decode and store with them against without
  mark_step transforms
  timeout 300 "$PYTHON" benchmarks/bench_transforms.py --out "$OUT/transforms.md" > "$OUT/bench_transforms.log" 2>&1 \
    || { status=1; tail -20 "$OUT/bench_transforms.log"; }
  cat "$OUT/transforms.md"
fi
if has head_dims; then  # the generic kernels' cost next to the tiled ones
  mark_step head_dims
  timeout 400 "$PYTHON" benchmarks/bench_head_dims.py --out "$OUT/head_dims.md" > "$OUT/bench_head_dims.log" 2>&1 \
    || { status=1; tail -20 "$OUT/bench_head_dims.log"; }
  cat "$OUT/head_dims.md"
fi
if has short; then  # the short-context shapes and tables only (one and 16 decode steps per graph)
  mark_step short
  timeout 400 "$PYTHON" benchmarks/bench_decode.py --shapes short --presets turboquant_4bit_nc turboquant_k8v4 \
    --out "$OUT/short.md" > "$OUT/bench_short.log" 2>&1 || { status=1; tail -20 "$OUT/bench_short.log"; }
  cat "$OUT/short.md"
fi
if has splits_short; then  # the split count at short contexts (the per-head kernel's lower bound)
  mark_step splits_short
  echo "== short decode vs splits"; PYTHONPATH=python timeout 200 "$PYTHON" benchmarks/sweep_splits.py --short --out "$OUT/splits_short.md" || status=1
  if [ -n "${SPLITS_TABLE_TOKENS:-}" ]; then  # again with a serving engine's block tables (e.g. 32768 tokens)
    echo "== short decode vs splits, block tables of $SPLITS_TABLE_TOKENS tokens"
    PYTHONPATH=python timeout 200 "$PYTHON" benchmarks/sweep_splits.py --short --table-tokens "$SPLITS_TABLE_TOKENS" \
      --out "$OUT/splits_short.md" || status=1
  fi
fi
if has serving; then  # block tables of a serving engine (32k tokens): default vs each kernel forced vs SDPA
  mark_step serving
  echo "== serving block tables"; PYTHONPATH=python timeout "${SERVING_TIMEOUT:-300}" "$PYTHON" benchmarks/bench_serving.py ${SERVING_ARGS:-} --out "$OUT/serving.md" \
    2>&1 | tee "$OUT/serving.log" | grep -E "^\|" || status=1
fi
if has breakdown; then  # decode kernel vs split merge vs whole step (benchmarks/decode_breakdown.py)
  mark_step breakdown
  echo "== decode breakdown"; PYTHONPATH=python timeout 240 "$PYTHON" benchmarks/decode_breakdown.py ${BREAKDOWN_ARGS:---placement} \
    --out "$OUT/breakdown.md" 2>&1 | tee "$OUT/breakdown.log" | grep -E "^\|" || status=1
fi
if has continuation; then  # decode_varlen vs dequantize + SDPA for continuation chunks
  mark_step continuation
  for kernel in decode chunked; do
    timeout 300 "$PYTHON" benchmarks/bench_continuation.py --kernel $kernel --out "$OUT/results.md" > "$OUT/bench_continuation_$kernel.log" 2>&1 || status=1
    tail -32 "$OUT/bench_continuation_$kernel.log"
  done
fi
if has speed; then  # context/batch sweep, plots and section in benchmarks/RESULTS.md
  mark_step speed
  cp benchmarks/RESULTS.md "$OUT/RESULTS.md"  # comes back updated: copy it over the repo's
  # The device copy's git metadata can be stale: the caller passes COMMIT=<hash> to name the commit.
  timeout 500 "$PYTHON" benchmarks/speed.py --out "$OUT/RESULTS.md" ${COMMIT:+--commit "$COMMIT"} > "$OUT/speed.log" 2>&1 || status=1
  tail -40 "$OUT/RESULTS.md"
fi
# Stall reasons of one kernel, overall and per SASS instruction: ncu_profile NAME KERNEL_REGEX ARGS...
# (ARGS: those of benchmarks/profile_kernels.py, e.g. decode, store, varlen --q-len 16)
# NCU_ARGS adds ncu options, e.g. "--warp-sampling-interval 0" (a sample every 32 cycles) for a
# kernel of a few microseconds, where the default interval leaves a few dozen samples.
ncu_profile() {
  local name=$1 kernel=$2; shift 2
  timeout 240 ncu --clock-control none --kernel-name "regex:$kernel" --launch-skip 1 --launch-count 1 ${NCU_ARGS:-} \
    --set full --import-source yes -o "$OUT/$name" -f "$PYTHON" benchmarks/profile_kernels.py "$@" > "$OUT/ncu_run_$name.log" 2>&1 || status=1
  ncu -i "$OUT/$name.ncu-rep" --page details > "$OUT/ncu_$name.txt" 2>&1
  ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_source_$name.csv" 2>&1
  echo "== ncu $name"
  grep -E "^    (Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Issued Warp|No Eligible|Warp Cycles Per Issued|Registers Per|Executed Ipc A)" "$OUT/ncu_$name.txt"
}
# The plain-decode kernel the default picks for the shape (decode_rows_kernel or decode_kernel;
# TURBOQUANT_DECODE_KERNEL=heads|rows forces one).
if has profile; then  # DECODE_SHAPE may list several shapes, separated by ";": one profile each
  mark_step profile
  IFS=';' read -ra profile_shapes <<< "${DECODE_SHAPE:-32 32 8 8192}"
  for shape in "${profile_shapes[@]}"; do
    name=decode_profile; [ "${#profile_shapes[@]}" -gt 1 ] && name=decode_profile_$(echo $shape | tr ' ' '_')
    ncu_profile "$name" "decode_(rows_)?kernel" decode --shape $shape
  done
fi
if has profile_kernels; then  # the per-head and the row kernel on each shape of DECODE_SHAPE (default 1 32 8 32768)
  mark_step profile_kernels
  IFS=';' read -ra profile_shapes <<< "${DECODE_SHAPE:-1 32 8 32768}"
  for shape in "${profile_shapes[@]}"; do
    for kernel in heads rows; do
      name=decode_profile_$kernel; [ "${#profile_shapes[@]}" -gt 1 ] && name=${name}_$(echo $shape | tr ' ' '_')
      TURBOQUANT_DECODE_KERNEL=$kernel ncu_profile "$name" "decode_(rows_)?kernel" decode --shape $shape ${PROFILE_ARGS:-}
    done
  done
fi
if has profile_store; then ncu_profile store_profile store_kv_kernel store; fi
if has profile_varlen; then  # the chunked varlen kernel on a long and a short chunk at L = 32k
  ncu_profile varlen128_profile decode_chunked_kernel varlen --shape 1 32 8 32768 --q-len 128
  ncu_profile varlen16_profile decode_chunked_kernel varlen --shape 1 32 8 32768 --q-len 16
fi
echo "== done in $(( $(date +%s) - start )) s"
kill "$clock_logger" 2>/dev/null
echo "== clocks per step (SM MHz min/median/max, W median, C max, event reasons seen)"
"$PYTHON" scripts/clock_summary.py "$OUT/clocks.csv" "$OUT/steps.txt" 2>&1 | head -20
# The device transfer returns only a handful of files: pack the logs, keep tables and plots loose.
logs=$(cd "$OUT" && ls *.log *.txt *.csv 2>/dev/null)
if [ -n "$logs" ]; then (cd "$OUT" && tar czf logs.tgz $logs && rm -f $logs); fi
exit $status
