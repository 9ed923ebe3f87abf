#!/usr/bin/env bash
# On the GPU machine: build jaxquant with its CUDA library, run the kernel tests (the cast
# kernels, the grouped GEMM kernel against the reference, grouped_dense through it, the
# GEMM dispatch), then the GEMM benchmark. Logs and gemm_<gpu>.json go to $OUT.
#
#   OUT=out bash scripts/gpu_gemm.sh [pytest args...]
#
# BENCH_ARGS passes flags to benchmarks/gemm.py (e.g. "--only grouped").
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi -L
source scripts/gpu_build.sh
gpu_build "$OUT/build.log" || exit 1
# tests/ops: only the GPU-marked tests; the others compare fp32 paths that XLA:GPU runs in
# TF32 and FP8 ones that run on FP8 tensor cores (see tests/kernels/test_grouped_gemm.py).
timeout -k 10 ${TEST_TIMEOUT:-240} python3 -m pytest -q -rf -p no:cacheprovider -n 8 tests/kernels \
  "$@" 2>&1 | tee "$OUT/tests.log" | tail -15
python3 -m pytest -q -s -p no:cacheprovider tests/kernels/test_grouped_gemm.py -k cublaslt 2>&1 \
  | grep -E "relative error|passed|failed"
timeout -k 10 ${TEST_TIMEOUT:-240} python3 -m pytest -q -rf -s -p no:cacheprovider -m gpu tests/ops \
  "$@" 2>&1 | tee "$OUT/tests_ops.log" | grep -E "relative error|passed|failed|FAILED|Error" | tail -20
# Each record is written as it is measured, so a run cut short keeps what it has. XLA's
# Triton GEMM autotuning took over 280 s to compile the MLP training steps on the H100
# (nothing measured); cuBLAS(Lt) takes those dots instead.
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false ${XLA_FLAGS:-}"
timeout -k 10 ${BENCH_TIMEOUT:-240} python3 benchmarks/gemm.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 \
  | tee "$OUT/gemm_bench.log" | grep --line-buffered -v "^jax.nn.scaled_matmul"
