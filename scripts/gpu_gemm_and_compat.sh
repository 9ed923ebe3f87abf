#!/usr/bin/env bash
# On the GPU machine: build with the CUDA library; run the whole CPU test suite on this
# machine's JAX (0.11.x) to check the code on both JAX versions; then the GEMM /
# training-step benchmark. Results and logs go to $OUT (default ./out).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
source scripts/gpu_build.sh
gpu_build "$OUT/build.log" || exit 1
JAX_PLATFORMS=cpu JAXQUANT_TEST_XLA_OPT=1 timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -n 14 -rf --tb=short \
  --ignore=tests/kernels/test_kernels_gpu.py tests > "$OUT/cpu_tests_jax011.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/cpu_tests_jax011.log" | tail -40
# As in gpu_gemm.sh: records are written as they come; Triton GEMM autotuning off.
XLA_FLAGS="--xla_gpu_enable_triton_gemm=false ${XLA_FLAGS:-}" timeout -k 10 ${BENCH_TIMEOUT:-300} \
  python3 benchmarks/gemm.py --out "$OUT" 2>&1 | tee "$OUT/gemm_bench.log" \
  | grep --line-buffered -v "^jax.nn.scaled_matmul"
