"""Where per-tensor FP8 quantization runs in a full train step: jaxquant's kernels or XLA.

    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python benchmarks/placement.py \
        [--shapes 8b] [--presets fp8_current,fp8_delayed] [--quick] [--out FILE]

jaxquant casts each GEMM operand with a kernel writing both usages' codes in one pass,
after (current scaling) the tensor's amax, an XLA reduction that XLA fuses into the op
producing the tensor (RMSNorm, SwiGLU, a residual add; kernels.amax.tensor_amax). A
kernel is a custom call, which XLA cannot fuse into anything; Flax's and Qwix's FP8
training leave the whole quantization to XLA instead. This benchmark times the step of
step.py (step_model.py's decoder stack, stock layers swapped in with `quantize_model`)
with the quantization placed four ways, chosen when the step is traced:

- `default`: jaxquant as it is;
- `amax_kernel`: the per-tensor amax by the amax kernel (`kernels.amax`), a pass of its own;
- `xla_cast`: amax and rowwise codes by XLA (a convert it fuses into the producer), the
  columnwise codes XLA's transpose of the rowwise ones;
- `xla_rowwise_cast`: XLA's rowwise codes, the cast kernel's columnwise codes.

The placements do the same arithmetic: XLA's convert is first checked bit for bit
against the reference cast on random and edge inputs (a placement whose codes differ is not
timed), and on the CPU every placement's step gives the default's loss bit for bit
(tests/benchmarks/test_placement.py). On the GPU each placement's first step's loss is
compared with the default's and printed; there they may differ, since XLA:GPU is free to
change a fusion's rounding and reduction order (its default `xla_allow_excess_precision`
lets a producer fused with the convert skip its bf16 rounding) and its fp32 division may
be 1 ulp off (tests/kernels/test_kernels_gpu.py, `reference_on_cpu`).

bf16 and Qwix's FP8 per tensor (where qwix is installed) are timed in the same interleaved
turns. Records, merged into benchmarks/results/<gpu>/placement.json: `step_ms`,
`speedup_vs_bf16` and, for the other placements, `speedup_vs_default` (the default
placement's step time over theirs), op `placement_<preset>_<placement>` (bf16 and Qwix:
`placement_bf16`, `placement_qwix_fp8_tensor`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import optax
import step
import step_variants
from records import ResultFile, results_path
from step_model import SHAPES, DecoderStack
from timing import interleaved_seconds, speedup

from jaxquant import kernels
from jaxquant.formats import ELEMENT_DTYPES, ELEMENT_MAX, Family
from jaxquant.kernels import _quantize as kernel_quantize
from jaxquant.kernels._amax import tensor_amax
from jaxquant.quantizers import DelayedFloat8Quantizer
from jaxquant.reference import _elements as elements
from jaxquant.reference import _fp8 as reference_fp8
from jaxquant.reference import _fp32 as fp32
from jaxquant.tensor import QuantizedData

PLACEMENTS = ("default", "amax_kernel", "xla_cast", "xla_rowwise_cast")
# The NaN code of each element (NUMERICS.md): XLA's convert gives others.
NAN_CODE = {"e4m3": 0x7F, "e5m2": 0x7E}


def xla_codes(x: jax.Array, scale: jax.Array, element: str, fmax: float) -> jax.Array:
  """Per-tensor FP8 codes of x * scale by XLA's convert: saturated to the format's largest
  value (the convert itself would overflow to NaN), NaN to the format's NaN code."""
  y = jnp.clip(x.astype(jnp.float32) * scale, -fmax, fmax)  # NaN passes through
  codes = elements.dtype_to_codes(y.astype(ELEMENT_DTYPES[element]))
  return elements.codes_to_dtype(
    jnp.where(jnp.isnan(y), jnp.uint8(NAN_CODE[element]), codes), element
  )


def xla_quantize_usages_and_amax(columnwise_by_kernel: bool):
  """`kernels.quantize_usages_and_amax` with per-tensor FP8 taken by XLA (other formats
  are left to the kernels)."""
  kernel_cast = kernel_quantize.quantize_usages_and_amax

  def cast(x2d, quantizer, usages, *, key=None, scale=None):
    fmt = quantizer.format("rowwise")
    if fmt.family is not Family.FP8_TENSOR:
      return kernel_cast(x2d, quantizer, usages, key=key, scale=scale)
    delayed_scale, observed = scale, None
    if isinstance(quantizer, DelayedFloat8Quantizer):
      observed = tensor_amax(x2d)  # the amax delayed scaling records
    else:
      scale = reference_fp8.scale_from_amax(
        tensor_amax(x2d),
        fmt.fmax,
        eps=quantizer.eps,
        pow2=quantizer.pow2_scales,
        input_dtype=x2d.dtype,
      )
    scale_inv = fp32.div(jnp.float32(1.0), scale)
    rowwise = xla_codes(x2d, scale, fmt.element, fmt.fmax)
    out = {}
    if "rowwise" in usages:
      out["rowwise"] = QuantizedData(rowwise, scale_inv, None, fmt)
    if "columnwise" in usages:
      if columnwise_by_kernel:
        out["columnwise"] = kernel_cast(
          x2d, quantizer, ("columnwise",), key=key, scale=delayed_scale
        )[0]["columnwise"]
      else:
        out["columnwise"] = QuantizedData(
          rowwise.T, scale_inv, None, quantizer.format("columnwise")
        )
    return out, observed

  return cast


@contextlib.contextmanager
def placed(placement: str):
  """jaxquant's per-tensor FP8 quantization placed as `placement` while a step is traced."""
  saved = kernel_quantize.tensor_amax, kernels.quantize_usages_and_amax
  jax.clear_caches()  # a trace made under another placement would be reused
  try:
    if placement == "amax_kernel":
      kernel_quantize.tensor_amax = kernels.amax
    if placement in ("xla_cast", "xla_rowwise_cast"):
      kernels.quantize_usages_and_amax = xla_quantize_usages_and_amax(
        columnwise_by_kernel=placement == "xla_rowwise_cast"
      )
    yield
  finally:
    kernel_quantize.tensor_amax, kernels.quantize_usages_and_amax = saved
    jax.clear_caches()


def xla_codes_differ() -> int:
  """Codes of XLA's convert that differ from the reference cast's, over random values
  across fp32's range and NUMERICS.md's edges, for both elements and three scales."""
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((1024, 1024)) * np.exp(rng.uniform(-30, 30, (1024, 1024)))).astype(
    np.float32
  )
  edges = np.float32(
    [
      0.0,
      -0.0,
      np.nan,
      np.inf,
      -np.inf,
      1e-45,
      -1e-45,
      1e-40,
      448,
      449,
      464,
      465,
      480,
      -480,
      57344,
      61440,
      1e30,
      -1e30,
      2.0**-10,
      1.5 * 2.0**-9,
      2.0**-17,
      1.5 * 2.0**-16,
    ]
  )
  x.flat[: edges.size] = edges
  differ = 0
  for element in ("e4m3", "e5m2"):
    fmax = ELEMENT_MAX[element]
    for scale in (1.0, 3.7, 1e-3):
      want = jax.jit(reference_fp8.cast, static_argnums=2)(x, jnp.float32(scale), element)
      got = jax.jit(xla_codes, static_argnums=(2, 3))(x, jnp.float32(scale), element, fmax)
      differ += int(
        np.sum(
          np.asarray(elements.dtype_to_codes(want)) != np.asarray(elements.dtype_to_codes(got))
        )
      )
  return differ


def run_shape(shape_name, presets, placements, args, results):
  shape = SHAPES[shape_name]
  stock = DecoderStack(shape, args.layers, attention=args.attention)
  params = step.init_variables(stock, shape.d_model)["params"]
  tx = optax.adamw(1e-4)
  opt_state = jax.jit(tx.init)(params)
  x = jax.random.normal(jax.random.key(2), (args.batch, args.seq, shape.d_model), jnp.bfloat16)
  key = jax.random.key(3)
  plan = [("bf16", "bf16", None)]
  if step_variants.qwix_unavailable_reason() is None:
    plan.append(("qwix_fp8_tensor", "qwix_fp8_tensor", None))
  else:
    print(f"Qwix skipped: {step_variants.qwix_unavailable_reason()}")
  plan += [
    (f"{preset}_{placement}", preset, placement) for preset in presets for placement in placements
  ]
  prepared, first_loss = {}, {}
  for label, name, placement in plan:
    variant = dataclasses.replace(step_variants.build(name, stock), name=label)
    collections = step.variant_collections(variant, params, shape.d_model)
    arguments = (params, opt_state, collections, x, key)
    with placed(placement) if placement else contextlib.nullcontext():
      prepared[label] = step.Prepared(
        variant, step.train_step(variant, tx), arguments, args.warmup_steps
      )
    hlo = prepared[label].executable.as_text()
    print(
      f"    {label}: {hlo.count('jaxquant_amax')} amax and {hlo.count('jaxquant_cast')} cast "
      "custom-call mentions in the optimized HLO"
    )
    first_loss[label] = np.asarray(prepared[label].executable(*arguments)[3])
    if placement and placement != "default":
      default = f"{name}_default"
      same = default in first_loss and first_loss[default].tobytes() == first_loss[label].tobytes()
      print(f"    {label}: first step's loss {'equals' if same else 'differs from'} {default}'s")
  samples = interleaved_seconds(
    {n: p.call for n, p in prepared.items()},
    reps=args.reps,
    rounds=args.rounds,
    warmup_s=args.warmup_s,
  )

  def add(name, metric, value):
    print(f"placement_{name:<32} {shape_name:<5} {metric:<20} {value:9.3f}", flush=True)
    results.add(f"placement_{name}", shape_name, metric, value)

  for label, times in samples.items():
    add(label, "step_ms", statistics.median(times) * 1e3)
    if label != "bf16":
      add(label, "speedup_vs_bf16", speedup(samples["bf16"], times)[0])
    preset = next((p for p in presets if label.startswith(p + "_")), None)
    if preset and not label.endswith("_default") and f"{preset}_default" in samples:
      add(label, "speedup_vs_default", speedup(samples[f"{preset}_default"], times)[0])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", default="8b")
  parser.add_argument("--presets", default="fp8_current,fp8_delayed")
  parser.add_argument("--placements", default=",".join(PLACEMENTS))
  parser.add_argument(
    "--quick", action="store_true", help="tiny shape, few repetitions, no results file unless --out"
  )
  parser.add_argument("--out")
  own, rest = parser.parse_known_args(argv)
  # Shape, batch, timing and attention options are step.py's.
  args = step.parse_args(["--shapes", own.shapes] + (["--quick"] if own.quick else []) + rest)
  presets = [p for p in own.presets.split(",") if p]
  placements = [p for p in own.placements.split(",") if p]
  unknown = sorted(set(placements) - set(PLACEMENTS))
  if unknown:
    parser.error(f"unknown placements {unknown}; placements are {list(PLACEMENTS)}")
  device = jax.devices()[0]
  print(
    f"{device.device_kind}, jax {jax.__version__}; jaxquant kernels: "
    f"{kernels.available() or kernels.unavailable_reason()}",
    flush=True,
  )
  differ = xla_codes_differ()
  print(f"XLA's convert against the reference cast: {differ} codes differ")
  if differ:
    placements = [p for p in placements if p in ("default", "amax_kernel")]
    print(f"timing only {placements}: the XLA casts do not compute the reference's codes")
  results = ResultFile(
    results_path(own.out, "placement", device.device_kind, smoke=own.quick),
    benchmark="placement",
    device=device.device_kind,
    jax_version=jax.__version__,
  )
  step.warm_backend(args)
  for shape_name in args.shapes:
    run_shape(shape_name, presets, placements, args, results)


if __name__ == "__main__":
  main()
