#!/usr/bin/env bash
# Isolates kernel crashes on the GPU machine: each cast alone in its own process (a crash
# loses only its line), with Python's fault handler, then one case under compute-sanitizer.
# Expects jaxquant installed (scripts/gpu_kernels.sh builds it). Output: $OUT/diagnose.log.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export JAXQUANT_FFI_LIBRARY=${JAXQUANT_FFI_LIBRARY:-$(cd /tmp && python3 -c "import jaxquant.kernels.library as l; print(l.library_path())")}
cat > /tmp/jq_case.py <<'PY'
import sys, jax, jax.numpy as jnp
from jaxquant import kernels
from jaxquant.quantizers import *
cases = {
  "nvfp4": (NVFP4Quantizer(), ("rowwise", "columnwise")),
  "mxfp8_row": (MXFP8Quantizer(), ("rowwise",)),
  "mxfp8_col": (MXFP8Quantizer(), ("columnwise",)),
  "fp8_delayed": (DelayedFloat8Quantizer(), ("rowwise",)),
  "block_row": (BlockFloat8Quantizer(), ("rowwise",)),
}
q, usages = cases[sys.argv[1]]
x = jax.random.normal(jax.random.key(0), (128, 256), jnp.bfloat16)
f = jax.jit(lambda x: kernels.quantize_usages(x, q, usages, scale=jnp.float32(2.0)))
print([l for l in f.lower(x).compile().as_text().splitlines() if "custom-call" in l][:3], flush=True)
out = jax.block_until_ready(f(x))
print(sys.argv[1], "OK", [(a.dtype, a.shape) for a in jax.tree.leaves(out)], flush=True)
PY
{
for c in nvfp4 mxfp8_row mxfp8_col fp8_delayed block_row; do
  echo "== $c"; timeout 60 python3 -X faulthandler /tmp/jq_case.py $c 2>&1 | grep -v "^  File.*site-packages" | tail -25
done
echo "== compute-sanitizer mxfp8_row"
timeout 150 compute-sanitizer --tool memcheck --print-limit 5 python3 /tmp/jq_case.py mxfp8_row 2>&1 | tail -40
} | tee "$OUT/diagnose.log"
