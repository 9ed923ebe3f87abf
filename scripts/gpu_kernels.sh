#!/usr/bin/env bash
# On the GPU machine, from a clean tree: build and install jaxquant with its CUDA library,
# run the kernel tests and the cast benchmark. Logs and results go to $OUT (default ./out).
#
#   bash scripts/gpu_kernels.sh [pytest args...]
#
# The build is the documented one-liner (no network needed: the machine's scikit-build-core,
# CMake, ninja and jaxlib headers are used):
#   python3 -m pip install --no-build-isolation --no-deps .
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
{ nvidia-smi -L; nvcc --version | tail -1; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } 2>&1 | tee "$OUT/env.log"

start=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -v . >"$OUT/build.log" 2>&1
status=$?
echo "pip install: exit $status in $(( $(date +%s) - start )) s" | tee -a "$OUT/env.log"
if [ $status -ne 0 ]; then tail -40 "$OUT/build.log"; exit 1; fi

# The tests import the source tree (cwd); point it at the library pip just installed.
export JAXQUANT_FFI_LIBRARY=$(cd /tmp && python3 -c "import jaxquant.kernels.library as l; print(l.library_path())")
python3 -c "import jaxquant.kernels as k; print('kernels available:', k.available(), k.unavailable_reason())" | tee -a "$OUT/env.log"

timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/run.py ${BENCH_ARGS:-} --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rf -p no:cacheprovider -n 8 tests/kernels "$@" 2>&1 \
  | tee "$OUT/tests.log" | tail -40
