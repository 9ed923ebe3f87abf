"""Cast-kernel benchmark: effective bandwidth against a device copy and the XLA reference.

    python benchmarks/run.py [--only REGEX] [--rows 16384 --cols 8192] [--quick]
    python benchmarks/run.py --profile [--only REGEX]   # each kernel once, for ncu

Everything is measured in one process: a device copy of the input (read + write, the
bandwidth ceiling; timed first and last, the faster counts), each cast through the CUDA
kernels, and the same cast through the XLA reference path (`implementation="reference"`).
Effective bandwidth counts the fewest bytes a cast must move: the input read once and every
output (data, scales) written once.
Prints a table and merges its records {"op", "shape", "metric", "value"} into
benchmarks/results/<gpu>/casts.json (records.py: a run replaces the records it measured and
keeps the others). Ratio metrics are fraction_of_copy (kernel bandwidth over the copy's
bandwidth in the same run) and speedup_vs_xla (reference time over kernel time); the
effective_tbps records carry the absolute numbers behind them.
"""

from __future__ import annotations

import argparse
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from records import ResultFile, results_path
from timing import device_seconds

from jaxquant import kernels, ops
from jaxquant.quantizers import (
  BlockFloat8Quantizer,
  DelayedFloat8Quantizer,
  Float8Quantizer,
  MXFP8Quantizer,
  NVFP4Quantizer,
)

BOTH = ("rowwise", "columnwise")


def time_ms(fn, *args, reps: int = 20, rounds: int = 5) -> float:
  return device_seconds(fn, *args, reps=reps, rounds=rounds) * 1e3


def nbytes(tree) -> int:
  return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def cast_only(q, usages):
  """The cast kernel alone, global amaxes given (as with delayed scaling or an amax fused
  upstream), and the same computation through the XLA reference lowering."""
  scale = jnp.float32(3.0) if isinstance(q, DelayedFloat8Quantizer) else None
  amaxes = functools.partial(kernels.cast_amaxes, quantizer=q, usages=usages, scale=scale)
  cast = functools.partial(kernels.cast, quantizer=q, usages=usages, key=jax.random.key(0))
  kernel = jax.jit(lambda x, r, c: cast(x, row_amax=r, col_amax=c))
  xla = jax.jit(lambda x, r, c: cast(x, row_amax=r, col_amax=c, implementation="reference"))
  return amaxes, kernel, xla


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rows", type=int, default=16384)
  parser.add_argument("--cols", type=int, default=8192)
  parser.add_argument(
    "--quick",
    action="store_true",
    help="fewer repetitions (a smoke run: no results file unless --out)",
  )
  parser.add_argument(
    "--out",
    default=None,
    help="results file to merge into (default benchmarks/results/<gpu>/casts.json)",
  )
  parser.add_argument(
    "--only", default=None, help="regex: run only the cases whose op name matches"
  )
  parser.add_argument(
    "--profile",
    action="store_true",
    help="run each kernel once, untimed and without the XLA path (under ncu)",
  )
  args = parser.parse_args()
  if not kernels.available():
    raise SystemExit(f"kernels unavailable: {kernels.unavailable_reason()}")
  reps = dict(reps=5, rounds=3) if args.quick else {}
  shape = (args.rows, args.cols)
  x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
  key = jax.random.key(1)
  # The copy is timed first and last, and the faster is the ceiling: its bandwidth drifts by
  # a few % between runs (2.71 and 2.83 TB/s on one H100), and a slow copy sample would
  # flatter every fraction.
  copy = jax.jit(lambda x: -x)
  copy_ms = [time_ms(copy, x, **reps)]
  measured = []  # (op, bytes moved, kernel ms, XLA ms or nan)

  cases = [
    # (op name, quantizer, usages, mode): mode "cast" gives the kernel its amaxes,
    # "quantize" includes the amax pass (the input is then read twice by the kernels).
    ("fp8_tensor_cast_transpose", DelayedFloat8Quantizer(), BOTH, "cast"),
    ("fp8_tensor_cast_row", DelayedFloat8Quantizer(), ("rowwise",), "cast"),
    ("fp8_current_amax_cast_transpose", Float8Quantizer(), BOTH, "quantize"),
    ("mxfp8_row_col", MXFP8Quantizer(), BOTH, "cast"),
    ("mxfp8_row", MXFP8Quantizer(), ("rowwise",), "cast"),
    ("nvfp4_row_col", NVFP4Quantizer(), BOTH, "cast"),
    ("nvfp4_row_col_incl_amax", NVFP4Quantizer(), BOTH, "quantize"),
    ("nvfp4_rht_row_col", NVFP4Quantizer(rht=True), BOTH, "cast"),
    ("nvfp4_rht_sr_row_col", NVFP4Quantizer(rht=True, stochastic_rounding=True), BOTH, "cast"),
    (
      "nvfp4_rht_sr_row_col_incl_amax",
      NVFP4Quantizer(rht=True, stochastic_rounding=True),
      BOTH,
      "quantize",
    ),
    ("nvfp4_16x16_row_col", NVFP4Quantizer(tile_2d=True), BOTH, "cast"),
    ("nvfp4_per_token_row", NVFP4Quantizer(per_token=True), ("rowwise",), "cast"),
    ("block_fp8_1x128_row_col", BlockFloat8Quantizer(), BOTH, "cast"),
    ("block_fp8_128x128_row_col", BlockFloat8Quantizer(block="128x128"), BOTH, "cast"),
  ]
  if args.only:
    cases = [c for c in cases if re.search(args.only, c[0])]
  rows = []
  for op, q, usages, mode in cases:
    if args.profile:
      amaxes, kernel, _ = cast_only(q, usages)
      jax.block_until_ready(kernel(x, *jax.jit(amaxes)(x)))
      continue
    if mode == "cast":
      amaxes, kernel, xla = cast_only(q, usages)
      r, c = jax.jit(amaxes)(x)
      kernel_args = xla_args = (x, r, c)
      out = kernel(*kernel_args)
    else:
      kernel = jax.jit(
        functools.partial(
          ops.quantize, quantizer=q, usages=usages, key=key, implementation="kernel"
        )
      )
      xla = jax.jit(
        functools.partial(
          ops.quantize, quantizer=q, usages=usages, key=key, implementation="reference"
        )
      )
      kernel_args = xla_args = (x,)
      out = kernel(x)
    moved = x.nbytes + nbytes(out)
    measured.append(
      (op, moved, time_ms(kernel, *kernel_args, **reps), time_ms(xla, *xla_args, **reps))
    )

  if args.profile:
    return
  deq = jax.jit(lambda qt: ops.dequantize(qt, "rowwise", jnp.bfloat16, implementation="kernel"))
  deq_xla = jax.jit(
    lambda qt: ops.dequantize(qt, "rowwise", jnp.bfloat16, implementation="reference")
  )
  for op, q in (
    ("mxfp8_dequantize_row", MXFP8Quantizer()),
    ("nvfp4_dequantize_row", NVFP4Quantizer()),
  ):
    qt = ops.quantize(x, q, ("rowwise",), implementation="kernel")
    moved = nbytes(qt.rowwise) + x.nbytes
    measured.append((op, moved, time_ms(deq, qt, **reps), time_ms(deq_xla, qt, **reps)))
  measured.append(
    ("amax_tensor", x.nbytes, time_ms(jax.jit(kernels.amax), x, **reps), float("nan"))
  )
  # The columnwise global amax of NVFP4 with RHT: the amax of the transformed data.
  amax_rht = jax.jit(functools.partial(kernels.amax, rht=True))
  measured.append(("amax_rht", x.nbytes, time_ms(amax_rht, x, **reps), float("nan")))

  copy_ms.append(time_ms(copy, x, **reps))
  copy_tbps = 2 * x.nbytes / min(copy_ms) / 1e9
  gpu = jax.devices()[0].device_kind
  results = ResultFile(
    results_path(args.out, "casts", gpu, smoke=args.quick),
    benchmark="casts",
    device=gpu,
    jax_version=jax.__version__,
  )

  def record(op, metric, value):
    results.add(op, list(shape), metric, value)

  record("device_copy", "effective_tbps", copy_tbps)
  for op, moved, k_ms, x_ms in measured:
    tbps = moved / k_ms / 1e9
    record(op, "effective_tbps", tbps)
    record(op, "fraction_of_copy", tbps / copy_tbps)
    if x_ms == x_ms:  # not nan: the op has an XLA path
      record(op, "speedup_vs_xla", x_ms / k_ms)
    rows.append((op, k_ms, x_ms, tbps, tbps / copy_tbps, x_ms / k_ms))

  print(
    f"\n{gpu}, input {shape} bf16, device copy {copy_tbps:.2f} TB/s "
    f"({' / '.join(f'{ms:.3f}' for ms in copy_ms)} ms, first / last)"
  )
  print(f"{'op':34s} {'kernel ms':>9s} {'xla ms':>8s} {'TB/s':>6s} {'of copy':>7s} {'vs xla':>7s}")
  for op, k_ms, x_ms, tbps, frac, speed in rows:
    print(f"{op:34s} {k_ms:9.3f} {x_ms:8.3f} {tbps:6.2f} {frac:7.2f} {speed:6.1f}x")
  print(f"merged into {results.path}" if results.path else "--quick: no results file written")


if __name__ == "__main__":
  main()
