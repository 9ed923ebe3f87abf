#!/usr/bin/env bash
# On the GPU machine, from a clean tree: build and install jaxquant with its CUDA library,
# run the kernel tests, then the cast benchmark. Logs and results go to $OUT (default ./out).
#
#   bash scripts/gpu_kernels.sh [pytest args...]
#
# NCU=1 also profiles each cast kernel once with Nsight Compute (ncu.txt) and writes an
# instruction-mix summary of the library's SASS (sass.txt).
# FALLBACK_FFI=DIR: if the tests fail, put DIR (a copy of a known-good ffi/) in place of
# ffi/, rebuild, and test and benchmark that instead (the failed log is tests_new.log).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
{ nvidia-smi -L; nvcc --version | tail -1; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } 2>&1 | tee "$OUT/env.log"

source scripts/gpu_build.sh
build() {  # $1: log file (in this shell, not a pipeline's subshell: it exports)
  gpu_build "$OUT/$1" > >(tee -a "$OUT/env.log") 2>&1 || exit 1
}

run_tests() {  # $1: log file; remaining: pytest args
  local log=$1; shift
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rf -p no:cacheprovider -n 8 tests/kernels "$@" 2>&1 \
    | tee "$OUT/$log" | tail -40
}

build build.log
run_tests tests.log "$@"
tests_status=$?
if [ $tests_status -ne 0 ] && [ -n "${FALLBACK_FFI:-}" ]; then
  echo "tests failed (exit $tests_status): falling back to $FALLBACK_FFI" | tee -a "$OUT/env.log"
  mv "$OUT/tests.log" "$OUT/tests_new.log"
  rm -rf ffi && cp -r "$FALLBACK_FFI" ffi
  build fb_build.log
  run_tests tests.log "$@"
  NCU=0
fi

timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/run.py ${BENCH_ARGS:-} --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"

if [ "${NCU:-0}" = 1 ]; then
  timeout ${NCU_TIMEOUT:-180} ncu --kernel-name regex:"fp8_tensor_cast|mxfp8_cast|nvfp4_cast|dequantize_kernel" \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section InstructionStats \
    --section ComputeWorkloadAnalysis \
    python3 benchmarks/run.py --profile ${NCU_ARGS:-} >"$OUT/ncu.txt" 2>&1
  echo "ncu: exit $?" | tee -a "$OUT/env.log"
  # Per kernel: instruction count of the SASS and its most frequent opcodes.
  cuobjdump -sass "$JAXQUANT_FFI_LIBRARY" | awk '
    /Function :/ { if (name) report(); name = $3; n = 0; delete ops; next }
    /^ +\/\*[0-9a-f]+\*\// { op = $2; if (op ~ /^@/) op = $3; sub(/[.;].*/, "", op); ops[op]++; n++ }
    function report() { s = ""; for (o in ops) s = s sprintf(" %s:%d", o, ops[o]); print name, n, s }
    END { report() }' >"$OUT/sass.txt" 2>&1
fi
