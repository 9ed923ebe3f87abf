"""Diagnostic (not committed): what the dispatch's per-tensor FP8 GEMM runs."""
import re, sys
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "diag")
import jax, jax.numpy as jnp, numpy as np
import gemm as gb
from fp8_data import time_ms
from jaxquant.ops import gemm as gemm_ops
from jaxquant import quantizers as Q
x, w = gb._operands(8192, 8192, 8192)
a, b = gb._quantized_pair(x, w, Q.Float8Quantizer())
print("a:", jax.tree.map(lambda l: (l.shape, l.dtype), a))
f = jax.jit(lambda a, b: gemm_ops.gemm(a, b, out_dtype=jnp.bfloat16))
print("gemm route ms (async reps)", time_ms(f, a, b), "median_seconds", gb.median_seconds(f, a, b) * 1e3)
dn = (((1,), (1,)), ((), ()))
s1 = jax.jit(lambda x, y, s, t: (jax.lax.dot_general(x, y, dn, preferred_element_type=jnp.float32) * (s * t)).astype(jnp.bfloat16))
print("bare S1 on the same data ms", time_ms(s1, a.data, b.data, a.scale_inv, b.scale_inv), "median_seconds", gb.median_seconds(s1, a.data, b.data, a.scale_inv, b.scale_inv) * 1e3)
bf = jax.jit(lambda a, b: jnp.dot(a, b.T, preferred_element_type=jnp.bfloat16))
print("bf16 ms", time_ms(bf, x, w), "median_seconds", gb.median_seconds(bf, x, w) * 1e3)
text = f.lower(a, b).compile().as_text()
entry = text[text.index("ENTRY"):]
for line in entry.splitlines()[:30]:
  print("   ", line[:260])
