"""GEMM and training-step benchmarks: every figure a ratio to bf16 `jnp.dot` of the same run.

    python benchmarks/gemm.py [--quick] [--out benchmarks/results]

Measures, at each shape (M, N, K) with random operands:
- `jnp.dot` bf16 (the baseline), XLA's FP8 `dot_general` on f8 operands;
- jaxquant's GEMM dispatch on pre-quantized FP8 per-tensor, MXFP8 and NVFP4 operands;
- `jax.nn.scaled_matmul` on pre-quantized MXFP8 / NVFP4 operands, where this JAX has it;
- `jaxquant.dense` forward under fp8_current and mxfp8, quantization included;
- a transformer MLP block's training step (forward + backward) under bf16, fp8_current, mxfp8.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp

import jaxquant
from jaxquant import quantizers as Q
from jaxquant.ops import gemm as gemm_ops

SHAPES = ((8192, 8192, 8192), (16384, 4096, 4096), (2048, 8192, 8192), (16, 8192, 8192))
QUICK_SHAPES = ((1024, 1024, 1024), (16, 1024, 1024))


def median_seconds(fn, *args, warmup: int = 3, iters: int = 20) -> float:
  """Median wall time of fn(*args) with the device synchronised after each call."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _operands(m, n, k, seed=0):
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = jax.random.normal(kw, (n, k), jnp.bfloat16)  # NUMERICS's w: [N, K]
  return x, w


def _quantized_pair(x, w, quantizer):
  quant = jax.jit(lambda t: jaxquant.reference.quantize(t, quantizer, "rowwise").rowwise)
  return quant(x), quant(w)


def _scaled_matmul_inputs(x, w, quantizer):
  """jax.nn.scaled_matmul operands [1, rows, K] from our rowwise MXFP8 / NVFP4 data."""
  a, b = _quantized_pair(x, w, quantizer)

  def unpack(qd):
    data = qd.data
    if qd.format.packed:  # E2M1 codes -> float4_e2m1fn elements
      codes = jaxquant.reference.elements.unpack_nibbles(data)
      data = jaxquant.reference.elements.decode(codes, "e2m1").astype(jnp.float4_e2m1fn)
    return data[None], qd.scale_inv[None]

  (ad, as_), (bd, bs) = unpack(a), unpack(b)
  return ad, bd, as_, bs


def _emit(records, record):
  """Keeps a record and prints it at once, so a run cut short still reports."""
  records.append(record)
  print(f"{record['op']:<44} {record['shape']:<36} {record['metric']:<16} {record['value']:8.3f}",
        flush=True)


def gemm_records(shapes, records):
  for m, n, k in shapes:
    flops = 2.0 * m * n * k
    x, w = _operands(m, n, k)
    base = median_seconds(jax.jit(lambda a, b: jnp.dot(a, b.T, preferred_element_type=jnp.bfloat16)), x, w)
    shape = f"{m}x{n}x{k}"
    _emit(records, {"op": "gemm_bf16_jnp_dot", "shape": shape, "metric": "tflops", "value": flops / base / 1e12})

    def add(op, seconds):
      _emit(records, {"op": op, "shape": shape, "metric": "speedup_vs_bf16", "value": base / seconds})
      _emit(records, {"op": op, "shape": shape, "metric": "tflops", "value": flops / seconds / 1e12})

    for name, quantizer in (("fp8_tensor", Q.Float8Quantizer()), ("mxfp8", Q.MXFP8Quantizer()),
                            ("nvfp4", Q.NVFP4Quantizer())):
      a, b = _quantized_pair(x, w, quantizer)
      add(f"gemm_{name}_prequantized",
          median_seconds(jax.jit(lambda a, b: gemm_ops.gemm(a, b, out_dtype=jnp.bfloat16)), a, b))
    for name, quantizer in (("mxfp8", Q.MXFP8Quantizer()), ("nvfp4", Q.NVFP4Quantizer())):
      try:
        args = _scaled_matmul_inputs(x, w, quantizer)
        fn = jax.jit(lambda ad, bd, as_, bs: jax.nn.scaled_matmul(
            ad, bd, as_, bs, preferred_element_type=jnp.bfloat16))
        add(f"jax_scaled_matmul_{name}_prequantized", median_seconds(fn, *args))
      except Exception as e:  # an older JAX or an unsupported pair: say so in the table
        print(f"jax.nn.scaled_matmul {name} unavailable at {shape}: {type(e).__name__}: {e}"[:300])
    if m % 128:  # dense also quantizes x columnwise (blocks along M) for its backward
      continue
    kernel = w.T  # Flax layout [K, N]
    for recipe in (jaxquant.recipes.fp8_current, jaxquant.recipes.mxfp8):
      fn = jax.jit(lambda x, kern, recipe=recipe: jaxquant.dense(x, kern, recipe=recipe, name="bench"))
      add(f"dense_fwd_{recipe.name}_incl_quantize", median_seconds(fn, x, kernel))


def mlp_step_records(records, tokens=16384, hidden=4096, ffn=16384):
  """Forward + backward of y = down(gelu(up(x))) under each recipe, vs bf16."""
  kx, ku, kd = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(kx, (tokens, hidden), jnp.bfloat16)
  up = (jax.random.normal(ku, (hidden, ffn), jnp.bfloat16) * hidden ** -0.5).astype(jnp.bfloat16)
  down = (jax.random.normal(kd, (ffn, hidden), jnp.bfloat16) * ffn ** -0.5).astype(jnp.bfloat16)

  def step_fn(recipe):
    def loss(params, x):
      h = jaxquant.dense(x, params[0], recipe=recipe, name="mlp/up")
      y = jaxquant.dense(jax.nn.gelu(h), params[1], recipe=recipe, name="mlp/down")
      return jnp.mean(y.astype(jnp.float32) ** 2)
    return jax.jit(jax.grad(loss))

  shape = f"tokens={tokens},hidden={hidden},ffn={ffn}"
  base = median_seconds(step_fn(jaxquant.recipes.bf16), (up, down), x, iters=10)
  for recipe in (jaxquant.recipes.fp8_current, jaxquant.recipes.mxfp8):
    t = median_seconds(step_fn(recipe), (up, down), x, iters=10)
    _emit(records, {"op": f"mlp_train_step_{recipe.name}", "shape": shape,
                    "metric": "speedup_vs_bf16", "value": base / t})


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
  parser.add_argument("--out", default="benchmarks/results")
  args = parser.parse_args()
  device = jax.devices()[0].device_kind.replace(" ", "_")
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  path = out / f"gemm_{device}.json"
  records = []
  try:
    mlp_step_records(records, *((1024, 256, 1024) if args.quick else ()))
    gemm_records(QUICK_SHAPES if args.quick else SHAPES, records)
  finally:  # whatever was measured is written, also when interrupted
    path.write_text(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                                "records": records}, indent=1))
    print(f"wrote {path}")

if __name__ == "__main__":
  main()
