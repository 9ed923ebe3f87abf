#!/usr/bin/env bash
# jaxquant on a GPU machine, one step per call, each one fitting a 10-minute device call:
#
#   bash scripts/gpu.sh build                      # build and install the CUDA library
#   bash scripts/gpu.sh test [PYTEST ARGS...]      # the GPU tests (default: tests/kernels, tests/ops -m gpu)
#   bash scripts/gpu.sh test cpu [PYTEST ARGS...]  # the CPU suite on this machine's JAX
#   bash scripts/gpu.sh bench NAME [ARGS...]       # casts (benchmarks/run.py), gemm, or benchmarks/NAME.py
#                                                  # (PROCESSES=N: as N processes, launch_local.py)
#   bash scripts/gpu.sh example [TRAIN_LM ARGS...] # examples/train_lm.py, every recipe, --preset gpu
#   bash scripts/gpu.sh seeds NAME [TRAIN_SEEDS ARGS...] -- [TRAIN_LM ARGS...] [+++ NAME ...]
#                                                  # examples/train_seeds.py, results in $OUT/NAME;
#                                                  # experiments separated by +++ run side by side
#
# Every step builds first, unless a library that loads is at hand: JAXQUANT_FFI_LIBRARY
# naming one (built beforehand and carried in), or the one this machine built from the same
# ffi/ sources in an earlier call (kept under /tmp while the machine stays warm). The build
# needs no network: it uses the machine's scikit-build-core, CMake, ninja and jaxlib, plus the
# wheels carried in .whl/ (nvidia-cutlass for the GEMM kernels' headers; docs/gpu.md says how
# to fetch them), installed into /tmp/site.
#
# Logs go to $OUT (default ./out); a benchmark merges its records into
# benchmarks/results/<gpu>/<name>.json and copies that file to $OUT/results/<gpu>/ (two
# folders down: what the device tool brings back), to be copied back into the tree. XLA's
# Triton GEMM autotuning is turned off for the benchmarks and the example: it took minutes
# to compile the quantized training steps, and cuBLAS(Lt) takes those dots instead. JAX
# lowers threefry hashes to its kernel (JAX_THREEFRY_GPU_KERNEL_LOWERING=1, as README
# advises for stochastic rounding): inlined, they doubled to tripled an NVFP4 step's
# compile time.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
CALL_BUDGET_S=${CALL_BUDGET_S:-585}  # the device call's 600 s, less a margin to copy $OUT
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

kernels_load() {  # with PYTHONPATH and JAXQUANT_FFI_LIBRARY as set: does the library load?
  python3 -c "import sys, jaxquant.kernels as k; print('kernels available:', k.available(), k.unavailable_reason() or ''); sys.exit(not k.available())"
}

build() {
  local log="$OUT/build.log"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the source tree, as the tests import it
  # The carried wheels: CUTLASS's headers for a build, and the peers (Qwix) that the
  # benchmarks import whether or not this call builds.
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl >"$log" 2>&1 || { tail -20 "$log"; return 1; }
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
  if [ -n "${JAXQUANT_FFI_LIBRARY:-}" ]; then
    echo "prebuilt library: $JAXQUANT_FFI_LIBRARY"
    kernels_load && return 0
    echo "it does not load: building"
  fi
  local sources kept
  sources=$(find ffi build_backend pyproject.toml -type f | sort | xargs sha1sum | sha1sum | cut -c1-16)
  kept=/tmp/jaxquant_ffi/$sources/libjaxquant_ffi.so
  if [ -f "$kept" ]; then
    export JAXQUANT_FFI_LIBRARY=$kept
    echo "library built from these sources in an earlier call: $kept"
    kernels_load && return 0
  fi
  unset JAXQUANT_FFI_LIBRARY
  python3 -m pip install --no-build-isolation --no-deps --force-reinstall -v . >>"$log" 2>&1
  local status=$?
  echo "pip install: exit $status after $(elapsed) s"
  if [ $status -ne 0 ]; then tail -40 "$log"; return 1; fi
  # The source tree shadows the installed package; point it at the library pip just built.
  local built
  built=$(cd /tmp && PYTHONPATH= python3 -c "import jaxquant.kernels as k; print(k.library_path())")
  mkdir -p "$(dirname "$kept")" && cp "$built" "$kept"
  export JAXQUANT_FFI_LIBRARY=$kept
  kernels_load
}

environment() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
}

remaining() {  # seconds left of the call's budget (at least 30, for a step that was given none)
  local left=$(( CALL_BUDGET_S - $(elapsed) ))
  echo $(( left > 30 ? left : 30 ))
}

triton_gemm_off() {
  export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false${XLA_FLAGS:+ $XLA_FLAGS}"
}

threefry_kernel_on() {  # unless the caller chose otherwise
  export JAX_THREEFRY_GPU_KERNEL_LOWERING=${JAX_THREEFRY_GPU_KERNEL_LOWERING:-1}
}

run_tests() {
  if [ "${1:-}" = cpu ]; then  # the whole CPU suite, on this machine's JAX version
    shift
    JAX_PLATFORMS=cpu timeout -k 10 $(remaining) python3 -m pytest -q -p no:cacheprovider -n 14 -rf \
      --tb=short --ignore=tests/kernels/test_kernels_gpu.py tests "$@" 2>&1 | tee "$OUT/tests_cpu.log" | tail -40
    return "${PIPESTATUS[0]}"
  fi
  if [ $# -gt 0 ]; then
    timeout -k 10 $(remaining) python3 -m pytest -q -rf -p no:cacheprovider "$@" 2>&1 | tee "$OUT/tests.log" | tail -40
    return "${PIPESTATUS[0]}"
  fi
  # tests/ops: only the GPU-marked tests; the others compare fp32 paths that XLA:GPU runs in
  # TF32 and FP8 ones that run on FP8 tensor cores (tests/kernels/test_grouped_gemm.py).
  local kernels ops
  timeout -k 10 $(( $(remaining) - 60 )) python3 -m pytest -q -rf -p no:cacheprovider -n 8 tests/kernels 2>&1 \
    | tee "$OUT/tests.log" | tail -30
  kernels=${PIPESTATUS[0]}
  timeout -k 10 $(remaining) python3 -m pytest -q -rf -p no:cacheprovider -m gpu tests/ops 2>&1 \
    | tee "$OUT/tests_ops.log" | tail -10
  ops=${PIPESTATUS[0]}
  [ "$kernels" -eq 0 ] && [ "$ops" -eq 0 ]
}

run_bench() {
  local name=${1:?"bench needs a name: casts, gemm, or a benchmarks/NAME.py"}; shift
  local script=benchmarks/$name.py
  [ "$name" = casts ] && script=benchmarks/run.py
  [ -f "$script" ] || { echo "no benchmark '$name' ($script is missing)"; return 2; }
  triton_gemm_off
  threefry_kernel_on
  echo "XLA_FLAGS=$XLA_FLAGS JAX_THREEFRY_GPU_KERNEL_LOWERING=$JAX_THREEFRY_GPU_KERNEL_LOWERING"
  # PROCESSES=N: one jax.distributed job of N processes on this host, each with its share
  # of the GPUs, as a job across hosts runs (README.md, "Several processes").
  local launch=()
  [ -n "${PROCESSES:-}" ] && launch=(python3 examples/launch_local.py --processes "$PROCESSES" --)
  timeout -k 10 $(remaining) "${launch[@]}" python3 "$script" "$@" 2>&1 | tee "$OUT/bench_$name.log" \
    | grep --line-buffered -v "^jax.nn.scaled_matmul"
  local status=${PIPESTATUS[0]}
  # Only this benchmark's file, two folders down: what the device tool brings back.
  local result
  for result in benchmarks/results/*/"$name".json; do
    [ -f "$result" ] || continue
    mkdir -p "$OUT/results/$(basename "$(dirname "$result")")"
    cp "$result" "$OUT/results/$(basename "$(dirname "$result")")/"
  done
  if [ "$name" = casts ] && [ "${NCU:-0}" = 1 ]; then  # each cast kernel once under Nsight Compute
    timeout $(remaining) ncu --kernel-name regex:"cast|dequantize_kernel" --section SpeedOfLight \
      --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats \
      --section MemoryWorkloadAnalysis --section InstructionStats --section ComputeWorkloadAnalysis \
      python3 benchmarks/run.py --profile "$@" >"$OUT/ncu.txt" 2>&1
    echo "ncu: exit $? ($OUT/ncu.txt)"
  fi
  return $status
}

run_example() {
  # Clocks, power and temperature every 5 s: a step time that drifts is then explained (or not).
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active \
    --format=csv -l 5 >"$OUT/gpu_clocks.csv" 2>/dev/null &
  local clock_log=$!
  triton_gemm_off
  threefry_kernel_on
  local budget
  budget=$(remaining)
  # train_lm.py rewrites its outputs after every recipe and stops itself within the budget,
  # so a run cut short still says which recipes finished.
  timeout $(( budget + 10 )) python3 examples/train_lm.py --recipes all --preset gpu --out "$OUT/lm" \
    --time-budget-s $(( budget - 15 )) "$@" 2>&1 | tee "$OUT/train_lm.log"
  local status=${PIPESTATUS[0]}
  echo "train_lm.py: exit $status (124: killed by the timeout) after $(elapsed) s"
  for f in results.md curves.json val_loss.png; do
    if [ -f "$OUT/lm/$f" ]; then cp "$OUT/lm/$f" "$OUT/$f"; else echo "missing: $f"; fi
  done
  for f in sensitivity.md sensitivity.png; do  # written with suggested_nvfp4 only
    [ -f "$OUT/lm/$f" ] && cp "$OUT/lm/$f" "$OUT/$f"
  done
  rm -rf "$OUT/lm"
  kill "$clock_log" 2>/dev/null
  return "$status"
}

run_seeds() {
  # Each experiment: NAME, then train_seeds.py's arguments (--gpus ... -- train_lm.py's).
  # All start at once with the call's remaining budget and stop themselves within it.
  nvidia-smi --query-gpu=index,timestamp,clocks.sm,power.draw,temperature.gpu,utilization.gpu,memory.used \
    --format=csv -l 5 >"$OUT/gpu_clocks.csv" 2>/dev/null &
  local clock_log=$!
  triton_gemm_off
  threefry_kernel_on
  local budget pids=() names=() experiment=() argument status=0 name
  budget=$(( $(remaining) - 20 ))  # the merge and the copy back after the budget
  launch() {
    [ ${#experiment[@]} -gt 0 ] || return 0
    name=${experiment[0]}
    mkdir -p "$OUT/$name"
    python3 examples/train_seeds.py --out "$OUT/$name" --time-budget-s "$budget" \
      "${experiment[@]:1}" >"$OUT/$name/train_seeds.log" 2>&1 &
    pids+=($!); names+=("$name")
    echo "$name: train_seeds.py ${experiment[*]:1} (budget $budget s)"
    experiment=()
  }
  for argument in "$@"; do
    if [ "$argument" = "+++" ]; then launch; else experiment+=("$argument"); fi
  done
  launch
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"; local code=$?
    echo "${names[$i]}: exit $code after $(elapsed) s"; tail -25 "$OUT/${names[$i]}/train_seeds.log"
    [ $code -eq 0 ] || status=$code
    # Each process's own plot is the merged one's part: keep its curves.json and log only.
    find "$OUT/${names[$i]}" -mindepth 2 -name val_loss.png -delete
  done
  kill "$clock_log" 2>/dev/null
  return $status
}

step=${1:-}
[ $# -gt 0 ] && shift
case "$step" in
  build|test|bench|example|seeds) ;;
  *) echo "usage: bash scripts/gpu.sh build | test [cpu] [PYTEST ARGS] | bench NAME [ARGS] | example [ARGS] | seeds NAME [ARGS] [+++ NAME ARGS]"
     exit 2 ;;
esac
environment 2>&1 | tee "$OUT/environment.log"
build || exit 1
echo "ready after $(elapsed) s"
case "$step" in
  build) ;;
  test) run_tests "$@" ;;
  bench) run_bench "$@" ;;
  example) run_example "$@" ;;
  seeds) run_seeds "$@" ;;
esac
