#!/usr/bin/env bash
# On the GPU machine (jax, flax, optax, matplotlib already there; nothing is installed):
# the language-model example, every recipe, --preset gpu, in one run of at most 560 s.
# Quantized recipes run through jaxquant's pure-JAX emulation (no cast kernels needed).
#
#   OUT=out bash scripts/gpu_example.sh [more train_lm.py flags, e.g. --steps 200]
#
# The script writes its outputs after every recipe, so even a run cut short by the timeout
# leaves results.md / curves.json / val_loss.png naming what finished and what did not run.
# Copied to $OUT: results.md, curves.json, val_loss.png, and the log train_lm.log.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT/lm"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
start=$(date +%s)
timeout 560 python3 examples/train_lm.py --recipes all --preset gpu --out "$OUT/lm" \
  --time-budget-s 540 "$@" \
  2>&1 | tee "$OUT/train_lm.log"
status=${PIPESTATUS[0]}
echo "train_lm.py exit status $status (124: killed by the 560 s timeout) after $(( $(date +%s) - start )) s"
for f in results.md curves.json val_loss.png; do
  if [ -f "$OUT/lm/$f" ]; then cp "$OUT/lm/$f" "$OUT/$f"; else echo "missing: $f"; fi
done
rm -rf "$OUT/lm"
cat "$OUT/results.md" 2>/dev/null
exit "$status"
