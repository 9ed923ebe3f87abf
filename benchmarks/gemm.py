"""GEMM and training-step benchmarks: every figure a ratio to bf16 `jnp.dot` of the same run.

    python benchmarks/gemm.py [--only gemm|grouped|mlp|accumulation ...] [--gemm-shapes MxNxK,...]
                              [--quick]

Measures, at each shape (M, N, K) with random operands:
- `jnp.dot` bf16 (the baseline), XLA's FP8 `dot_general` on f8 operands;
- jaxquant's GEMM dispatch on pre-quantized FP8 per-tensor, block FP8, MXFP8 and NVFP4
  operands, and two other spellings of the per-tensor FP8 GEMM;
- `jax.nn.scaled_matmul` on pre-quantized MXFP8 / NVFP4 operands, where this JAX has it;
- `jaxquant.dense` forward under fp8_current and mxfp8, quantization included.
GEMMs with at most 64 rows run 8 to a jitted call (distinct operands), so that JAX's
dispatch, longer than such a GEMM, stays out of their times. MXFP8 and NVFP4 are also
compared with `jax.nn.scaled_matmul` directly (`speedup_vs_jax_scaled_matmul`).
Also a transformer MLP block's training step (forward + backward) under bf16, fp8_current,
fp8_block and mxfp8, and grouped GEMMs (bf16, FP8) through jaxquant's grouped kernel, grouped
by rows (fprop, dgrad; and `jax.lax.ragged_dot` with --ragged-dot) and by the contraction
(`grouped_wgrad_*`), each against the dense GEMM of the same FLOPs and format. The
accumulation section times the per-tensor FP8 kernel with and without fast accumulation
(recipes.CustomRecipe) at the 8B decoder layer's GEMM shapes, and records each mode's
normwise error against a float64 oracle as k grows, on signed and on all-positive codes
(where truncated partial sums add up instead of cancelling).
Times are device times of back-to-back calls, each figure's baseline and
contenders timed in turns over several rounds (timing.py); a ratio is that of the median
times, and its `_lowest_round` record the lowest ratio within one round. Records are merged
into benchmarks/results/<gpu>/gemm.json as they are measured (records.py: a run replaces
the records it measured and keeps the others).
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from records import ResultFile, results_path
from timing import Call, batched, interleaved_seconds, speedup

import jaxquant
from jaxquant import kernels, ops
from jaxquant import quantizers as Q

SHAPES = ((8192, 8192, 8192), (16384, 4096, 4096), (2048, 8192, 8192), (16, 8192, 8192))
QUICK_SHAPES = ((1024, 1024, 1024), (16, 1024, 1024))


def _operands(m, n, k, seed=0):
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = jax.random.normal(kw, (n, k), jnp.bfloat16)  # NUMERICS's w: [N, K]
  return x, w


def _quantized_pair(x, w, quantizer, w_quantizer=None):
  quant = lambda q: jax.jit(lambda t: jaxquant.reference.quantize(t, q, "rowwise").rowwise)
  return quant(quantizer)(x), quant(w_quantizer or quantizer)(w)


def _scaled_matmul_inputs(x, w, quantizer):
  """jax.nn.scaled_matmul operands [1, rows, K] from our rowwise MXFP8 / NVFP4 data."""
  a, b = _quantized_pair(x, w, quantizer)

  def unpack(qd):
    data = qd.data
    if qd.format.packed:  # E2M1 codes -> float4_e2m1fn elements
      codes = jaxquant.reference.unpack_nibbles(data)
      data = jaxquant.reference.decode(codes, "e2m1").astype(jnp.float4_e2m1fn)
    return data[None], qd.scale_inv[None]

  (ad, as_), (bd, bs) = unpack(a), unpack(b)
  return ad, bd, as_, bs


class Records:
  """Prints each record as it arrives and merges it into the result file at once, so a run
  cut short (even killed) keeps what it measured."""

  def __init__(self, results: ResultFile):
    self.results = results

  def add(self, record):
    print(
      f"{record['op']:<44} {record['shape']:<36} {record['metric']:<20} {record['value']:8.3f}",
      flush=True,
    )
    self.results.add(record["op"], record["shape"], record["metric"], record["value"])


def _fp8_spellings(pairs):
  """Other routes to the same per-tensor FP8 GEMM: the dot's own bf16 output (scales after,
  a second rounding), and jaxquant's grouped kernel with one group (scales fused)."""
  dims = (((1,), (1,)), ((), ()))
  bf16_out = lambda a, b: (
    jax.lax.dot_general(a.data, b.data, dims, preferred_element_type=jnp.bfloat16)
    * (a.scale_inv * b.scale_inv)
  ).astype(jnp.bfloat16)
  calls = {"gemm_fp8_tensor_xla_bf16_out": batched(bf16_out, pairs)}
  if kernels.available():
    one = lambda a, b: kernels.grouped_gemm(
      a.data,
      b.data[None],
      jnp.full((1,), a.data.shape[0], jnp.int32),
      (a.scale_inv * b.scale_inv).reshape(1),
      jnp.bfloat16,
    )
    calls["gemm_fp8_tensor_jaxquant_kernel"] = batched(one, pairs)
  return calls


def _runs(name, call):
  """Whether `call` runs on this JAX and GPU (warming it up); says why in the table if not."""
  try:
    jax.block_until_ready(call())
    return True
  except Exception as e:  # an older JAX or an unsupported pair
    print(f"{name} unavailable: {type(e).__name__}: {e}"[:300])
    return False


def _add_speedups(records, shape, samples, base, metric, flops=None):
  """Every contender's speedup over `base` (ratio of medians, and its lowest round)."""
  for op, times in samples.items():
    if op == base:
      continue
    value, lowest = speedup(samples[base], times)
    records.add({"op": op, "shape": shape, "metric": metric, "value": value})
    records.add({"op": op, "shape": shape, "metric": f"{metric}_lowest_round", "value": lowest})
    if flops:
      records.add(
        {
          "op": op,
          "shape": shape,
          "metric": "tflops",
          "value": flops / statistics.median(times) / 1e12,
        }
      )


# GEMMs with at most this many rows are timed as 8 independent calls in one jitted call
# (timing.batched), every other shape as one.
SMALL_ROWS, SMALL_COPIES = 64, 8


def gemm_records(shapes, records):
  """Per shape, bf16 `jnp.dot` and every contender timed in turns (timing.interleaved_seconds)."""
  for m, n, k in shapes:
    flops = 2.0 * m * n * k
    copies = SMALL_COPIES if m <= SMALL_ROWS else 1
    operands = [_operands(m, n, k, seed=i) for i in range(copies)]
    calls = {
      "gemm_bf16_jnp_dot": batched(
        lambda a, b: jnp.dot(a, b.T, preferred_element_type=jnp.bfloat16), operands
      )
    }
    block = (Q.BlockFloat8Quantizer(block="1x128"), Q.BlockFloat8Quantizer(block="128x128"))
    for name, quantizers in (
      ("fp8_tensor", (Q.Float8Quantizer(),)),
      ("fp8_block", block),
      ("mxfp8", (Q.MXFP8Quantizer(),)),
      ("nvfp4", (Q.NVFP4Quantizer(),)),
    ):
      pairs = [_quantized_pair(x, w, *quantizers) for x, w in operands]
      calls[f"gemm_{name}_prequantized"] = batched(
        lambda a, b: ops.gemm(a, b, out_dtype=jnp.bfloat16), pairs
      )
      if name == "fp8_tensor":
        calls.update(_fp8_spellings(pairs))
    for name, quantizer in (("mxfp8", Q.MXFP8Quantizer()), ("nvfp4", Q.NVFP4Quantizer())):
      fn = lambda ad, bd, as_, bs: jax.nn.scaled_matmul(
        ad, bd, as_, bs, preferred_element_type=jnp.bfloat16
      )
      try:
        call = batched(fn, [_scaled_matmul_inputs(x, w, quantizer) for x, w in operands])
      except Exception as e:  # an older JAX without jax.nn.scaled_matmul
        print(f"jax.nn.scaled_matmul {name}: {type(e).__name__}: {e}"[:300])
        continue
      if _runs(f"jax.nn.scaled_matmul {name} at {m}x{n}x{k}", call):
        calls[f"jax_scaled_matmul_{name}_prequantized"] = call
    if m % 128 == 0:  # dense also quantizes x columnwise (blocks along M) for its backward
      x, w = operands[0]
      kernel = w.T  # Flax layout [K, N]
      for recipe in (jaxquant.recipes.fp8_current, jaxquant.recipes.mxfp8):
        fn = jax.jit(
          lambda x, kern, recipe=recipe: jaxquant.dense(x, kern, recipe=recipe, name="bench")
        )
        calls[f"dense_fwd_{recipe.name}_incl_quantize"] = Call(fn, (x, kernel))
    samples = interleaved_seconds(calls)
    shape = f"{m}x{n}x{k}"
    records.add(
      {
        "op": "gemm_bf16_jnp_dot",
        "shape": shape,
        "metric": "tflops",
        "value": flops / statistics.median(samples["gemm_bf16_jnp_dot"]) / 1e12,
      }
    )
    _add_speedups(records, shape, samples, "gemm_bf16_jnp_dot", "speedup_vs_bf16", flops)
    for name in ("mxfp8", "nvfp4"):  # JAX's own block-scaled GEMM: the second yardstick
      theirs = f"jax_scaled_matmul_{name}_prequantized"
      if theirs in samples:
        _add_speedups(
          records,
          shape,
          {
            theirs: samples[theirs],
            f"gemm_{name}_prequantized": samples[f"gemm_{name}_prequantized"],
          },
          theirs,
          "speedup_vs_jax_scaled_matmul",
        )


# The 8B step's per-tensor FP8 GEMMs (benchmarks/step_model.py, 4 x 4096 tokens): fprop
# and dgrad of the attention and MLP projections, and the MLP's wgrads (k = the tokens).
ACCUMULATION_SHAPES = (
  (16384, 4096, 4096),
  (16384, 1024, 4096),
  (16384, 14336, 4096),
  (16384, 4096, 14336),
  (4096, 14336, 16384),
  (14336, 4096, 16384),
)
QUICK_ACCUMULATION_SHAPES = ((1024, 1024, 1024),)
ACCURACY_KS, QUICK_ACCURACY_KS = (1024, 4096, 16384, 65536), (1024,)


def _fp8_codes(key, rows, k, dtype, positive=False):
  x = jax.random.normal(key, (rows, k), jnp.float32) * 8
  return (jnp.abs(x) if positive else x).astype(dtype)


def accumulation_records(shapes, ks, records):
  """The per-tensor FP8 kernel with split (promoted) and fast accumulation: speed against
  bf16 `jnp.dot` and each other, and accuracy against a float64 oracle."""
  if not kernels.available():
    print(f"accumulation: skipped, the kernels are unavailable ({kernels.unavailable_reason()})")
    return
  one = jnp.float32(1.0)
  modes = {"split": False, "fast": True}
  gemm = lambda fast: jax.jit(
    lambda a, b: kernels.fp8_tensor_gemm(
      a, b, one, one, out_dtype=jnp.bfloat16, fast_accumulation=fast
    )
  )
  for m, n, k in shapes:
    x, w = _operands(m, n, k)
    a, b = (
      _fp8_codes(jax.random.key(i), rows, k, jnp.float8_e4m3fn) for i, rows in enumerate((m, n))
    )
    calls = {"gemm_bf16_jnp_dot": Call(jax.jit(lambda x, w: jnp.dot(x, w.T)), (x, w))}
    calls.update(
      {
        f"gemm_fp8_tensor_{mode}_accumulation": Call(gemm(fast), (a, b))
        for mode, fast in modes.items()
      }
    )
    samples = interleaved_seconds(calls)
    shape = f"{m}x{n}x{k}"
    _add_speedups(records, shape, samples, "gemm_bf16_jnp_dot", "speedup_vs_bf16", 2.0 * m * n * k)
    _add_speedups(
      records,
      shape,
      {op: samples[op] for op in calls if op.startswith("gemm_fp8")},
      "gemm_fp8_tensor_split_accumulation",
      "speedup_vs_split_accumulation",
    )
  rows = 512
  for k in ks:
    for data, positive in (("signed", False), ("positive", True)):
      a = _fp8_codes(jax.random.key(k), rows, k, jnp.float8_e4m3fn, positive)
      b = _fp8_codes(jax.random.key(k + 1), rows, k, jnp.float8_e5m2, positive)
      f64 = lambda t: np.asarray(t.astype(jnp.float32), np.float64)
      want = f64(a) @ f64(b).T
      for mode, fast in modes.items():
        got = np.asarray(
          jax.jit(
            lambda a, b, fast=fast: kernels.fp8_tensor_gemm(a, b, one, one, fast_accumulation=fast)
          )(a, b),
          np.float64,
        )
        error = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        records.add(
          {
            "op": f"gemm_fp8_tensor_{mode}_accumulation",
            "shape": f"{rows}x{rows}x{k} {data}",
            "metric": "relative_error",
            "value": error,
          }
        )


GROUPED_SHAPES = ((8, 16384, 4096, 4096), (64, 32768, 2048, 1408))  # (G, M, K, N)
QUICK_GROUPED_SHAPES = ((4, 1024, 256, 256),)


def _group_sizes(num_groups, rows, balanced, seed=0):
  """Equal sizes, or sizes drawn like a router's (Dirichlet shares), summing to rows."""
  if balanced:
    return jnp.full((num_groups,), rows // num_groups, jnp.int32)
  shares = jax.random.dirichlet(jax.random.key(seed), jnp.ones((num_groups,)))
  sizes = jnp.floor(shares * rows).astype(jnp.int32)
  return sizes.at[0].add(rows - sizes.sum())


def grouped_records(shapes, records, with_ragged_dot=False):
  """Grouped GEMM at (G, M, K, N) as a ratio to the dense [M, K] x [K, N] GEMM (same FLOPs)."""
  if not kernels.available() and not with_ragged_dot:
    print(f"grouped kernel unavailable: {kernels.unavailable_reason()}")
    return
  for g, m, k, n in shapes:
    shape = f"G={g},M={m},K={k},N={n}"
    kx, kw = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (g, n, k), jnp.bfloat16)
    alpha = jnp.full((g,), 0.5, jnp.float32)
    xf, wf = x.astype(jnp.float8_e4m3fn), w.astype(jnp.float8_e4m3fn)
    calls = {
      "dense_bf16": Call(
        jax.jit(lambda a, b: jnp.dot(a, b.T, preferred_element_type=jnp.bfloat16)), (x, w[0])
      ),
      "dense_fp8": Call(
        jax.jit(
          lambda a, b: (
            jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            * 0.5
          ).astype(jnp.bfloat16)
        ),
        (xf, wf[0]),
      ),
    }
    run = jax.jit(lambda a, b, s, al: kernels.grouped_gemm(a, b, s, al, jnp.bfloat16))
    ragged = jax.jit(
      lambda a, b, s: jax.lax.ragged_dot(
        a, jnp.swapaxes(b, 1, 2), s, preferred_element_type=jnp.bfloat16
      )
    )
    # wgrad: each group's [K, rows] x [rows, N], the operands transposed in the kernel's
    # aligned columns; its dense GEMM of the same FLOPs is [K, M] x [M, N].
    columns = m + 16 * g  # room for every group's start to be rounded up to 16 columns
    xt = jax.random.normal(kx, (k, columns), jnp.bfloat16)
    dyt = jax.random.normal(kw, (n, columns), jnp.bfloat16)
    xtf, dytf = xt.astype(jnp.float8_e4m3fn), dyt.astype(jnp.float8_e5m2)
    tn = lambda a, b: jax.lax.dot_general(
      a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    calls["dense_bf16_wgrad"] = Call(jax.jit(tn), (xt[:, :m], dyt[:, :m]))
    calls["dense_fp8_wgrad"] = Call(jax.jit(tn), (xtf[:, :m], dytf[:, :m]))
    wgrad = jax.jit(lambda a, b, s, al: kernels.grouped_wgrad(a, b, s, al, jnp.float32))
    for tag, balanced in (("balanced", True), ("dirichlet", False)):
      sizes = _group_sizes(g, m, balanced)
      if kernels.available():
        calls[f"grouped_bf16_jaxquant_kernel,{tag}"] = Call(run, (x, w, sizes, alpha))
        calls[f"grouped_fp8_jaxquant_kernel,{tag}"] = Call(run, (xf, wf, sizes, alpha))
        calls[f"grouped_wgrad_bf16_jaxquant_kernel,{tag}"] = Call(wgrad, (xt, dyt, sizes, alpha))
        calls[f"grouped_wgrad_fp8_jaxquant_kernel,{tag}"] = Call(wgrad, (xtf, dytf, sizes, alpha))
      if with_ragged_dot:  # XLA's own grouped GEMM, the baseline to beat (slow to compile)
        calls[f"grouped_bf16_lax_ragged_dot,{tag}"] = Call(ragged, (x, w, sizes))
    samples = interleaved_seconds(calls)
    for name, times in samples.items():
      if name.startswith("grouped_"):
        op, tag = name.split(",")
        base = "dense_fp8" if "_fp8_" in op else "dense_bf16"
        base = samples[base + ("_wgrad" if "_wgrad_" in op else "")]
        value, lowest = speedup(base, times)
        records.add(
          {"op": op, "shape": f"{shape},{tag}", "metric": "vs_dense_same_format", "value": value}
        )
        records.add(
          {
            "op": op,
            "shape": f"{shape},{tag}",
            "metric": "vs_dense_same_format_lowest_round",
            "value": lowest,
          }
        )


def mlp_step_records(records, tokens=16384, hidden=4096, ffn=16384):
  """Forward + backward of y = down(gelu(up(x))) under each recipe, vs bf16 (timed in turns)."""
  kx, ku, kd = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(kx, (tokens, hidden), jnp.bfloat16)
  up = (jax.random.normal(ku, (hidden, ffn), jnp.bfloat16) * hidden**-0.5).astype(jnp.bfloat16)
  down = (jax.random.normal(kd, (ffn, hidden), jnp.bfloat16) * ffn**-0.5).astype(jnp.bfloat16)

  def step_fn(recipe):
    def loss(params, x):
      h = jaxquant.dense(x, params[0], recipe=recipe, name="mlp/up")
      y = jaxquant.dense(jax.nn.gelu(h), params[1], recipe=recipe, name="mlp/down")
      return jnp.mean(y.astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss))

  shape = f"tokens={tokens},hidden={hidden},ffn={ffn}"
  recipes = (
    jaxquant.recipes.bf16,
    jaxquant.recipes.fp8_current,
    jaxquant.recipes.fp8_block,
    jaxquant.recipes.mxfp8,
  )
  samples = interleaved_seconds(
    {f"mlp_train_step_{r.name}": Call(step_fn(r), ((up, down), x)) for r in recipes},
    reps=5,
    rounds=8,
  )
  base = "mlp_train_step_bf16"
  records.add(
    {"op": base, "shape": shape, "metric": "ms", "value": statistics.median(samples[base]) * 1e3}
  )
  _add_speedups(records, shape, samples, base, "speedup_vs_bf16")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--quick", action="store_true", help="small shapes (a smoke run: no results file unless --out)"
  )
  parser.add_argument(
    "--out",
    default=None,
    help="results file to merge into (default benchmarks/results/<gpu>/gemm.json)",
  )
  parser.add_argument(
    "--ragged-dot",
    action="store_true",
    help="also time jax.lax.ragged_dot in the grouped section (minutes to compile)",
  )
  parser.add_argument("--gemm-shapes", help="MxNxK,... for the gemm section (default: the four)")
  parser.add_argument(
    "--only",
    choices=("gemm", "grouped", "mlp", "accumulation"),
    action="append",
    help="run only these sections (repeatable; default: all)",
  )
  args = parser.parse_args()
  device = jax.devices()[0].device_kind
  records = Records(
    ResultFile(
      results_path(args.out, "gemm", device, smoke=args.quick),
      benchmark="gemm",
      device=device,
      jax_version=jax.__version__,
    )
  )
  sections = set(args.only or ("gemm", "grouped", "mlp", "accumulation"))
  if "accumulation" in sections:
    accumulation_records(
      QUICK_ACCUMULATION_SHAPES if args.quick else ACCUMULATION_SHAPES,
      QUICK_ACCURACY_KS if args.quick else ACCURACY_KS,
      records,
    )
  if "grouped" in sections:
    grouped_records(
      QUICK_GROUPED_SHAPES if args.quick else GROUPED_SHAPES,
      records,
      with_ragged_dot=args.ragged_dot,
    )
  if "mlp" in sections:  # before the long gemm section, so a cut-short run still has it
    mlp_step_records(records, *((1024, 256, 1024) if args.quick else ()))
  if "gemm" in sections:
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.gemm_shapes:
      shapes = [tuple(int(d) for d in s.split("x")) for s in args.gemm_shapes.split(",")]
    gemm_records(shapes, records)
  print(
    f"merged into {records.results.path}"
    if records.results.path
    else "--quick: no results file written"
  )


if __name__ == "__main__":
  main()
