#!/usr/bin/env bash
# On the GPU machine: build jaxquant's CUDA library (the documented one-liner) unless a
# prebuilt one is given, then the language-model example, every recipe, --preset gpu, all
# inside one call of at most 600 s. The bf16 noise floor does not fit in the same call
# (the eight recipes take about 560 s); it is a second one:
#
#   OUT=out bash scripts/gpu_example.sh --recipes bf16 --noise-floor
#
#   OUT=out bash scripts/gpu_example.sh [more train_lm.py flags, e.g. --steps 200]
#   OUT=out JAXQUANT_FFI_LIBRARY=/path/libjaxquant_ffi.so bash scripts/gpu_example.sh
#
# Casts run through the FFI kernels (the build's), GEMMs through the dispatch table's GPU
# entries. The script writes its outputs after every recipe, so even a run cut short by the
# timeout leaves results.md / curves.json / val_loss.png naming what finished and what did
# not run. Copied to $OUT: results.md, curves.json, val_loss.png, the logs.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT/lm"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
# Clocks, power and temperature every 5 s: a step time that drifts is then explained (or not).
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active \
  --format=csv -l 5 >"$OUT/gpu_clocks.csv" 2>/dev/null &
clock_log=$!
source scripts/gpu_build.sh
gpu_build "$OUT/build.log" || exit 1  # or the library JAXQUANT_FFI_LIBRARY names
python3 -c "import jax, flax, optax, jaxquant.kernels as k; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices()); print('kernels available:', k.available(), k.unavailable_reason())"
# XLA's Triton GEMM autotuning dominates the quantized recipes' compile time (tens of
# seconds per recipe for the FP8 and NVFP4 dots); cuBLAS(Lt) takes their dots instead.
fast_compile="--xla_gpu_enable_triton_gemm=false"
if XLA_FLAGS="$fast_compile" python3 -c "import jax.numpy as jnp; jnp.ones(1).block_until_ready()" 2>/dev/null; then
  export XLA_FLAGS="$fast_compile ${XLA_FLAGS:-}"
fi
echo "XLA_FLAGS=${XLA_FLAGS:-}"
built=$(date +%s)
echo "build and imports: $(( built - start )) s"
budget=$(( ${CALL_BUDGET_S:-585} - (built - start) ))
timeout $(( budget + 15 )) python3 examples/train_lm.py --recipes all --preset gpu --out "$OUT/lm" \
  --time-budget-s $(( budget - 10 )) "$@" \
  2>&1 | tee "$OUT/train_lm.log"
status=${PIPESTATUS[0]}
echo "train_lm.py exit status $status (124: killed by the timeout) after $(( $(date +%s) - built )) s"
for f in results.md curves.json val_loss.png; do
  if [ -f "$OUT/lm/$f" ]; then cp "$OUT/lm/$f" "$OUT/$f"; else echo "missing: $f"; fi
done
rm -rf "$OUT/lm"
kill "$clock_log" 2>/dev/null
cat "$OUT/results.md" 2>/dev/null
exit "$status"
