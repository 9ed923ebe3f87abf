"""Casting one shard of a sharded matrix to the bits the whole matrix's cast gives there.

Run inside a `shard_map` over every mesh axis, where each device holds one shard. Scaling
blocks that lie whole inside a shard see exactly the values they see in the whole matrix,
so block scales and codes come out the same; the RHT too, whose runs of 16 lie inside a
block. What the whole matrix shares is its per-tensor amax (FP8 current scaling, NVFP4's
global amax; per row for per-token NVFP4): each shard takes its own and they are reduced
across the shards exactly (`kernels.sharding.pmax_amax`) before the cast, which takes them
as inputs (the cast primitive's contract, kernels/_cast.py). Delayed scaling's scale is
given; its recorded amax is the reduced one.

Stochastic rounding is not reproduced: its random bits are one stream over the whole
matrix's element indices, which a shard's cast cannot draw its part of (callers refuse it).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from jaxquant import kernels
from jaxquant.kernels._cast import cast_p
from jaxquant.kernels._config import cast_config, unsupported_reason
from jaxquant.kernels._reference_cast import reference_cast
from jaxquant.kernels._sharding import pmax_amax
from jaxquant.ops._backend import Backend
from jaxquant.quantizers import (
  BaseQuantizer,
  DelayedFloat8Quantizer,
  Float8Quantizer,
  NVFP4Quantizer,
)
from jaxquant.reference import _fp32 as fp32
from jaxquant.reference import _hadamard as hadamard
from jaxquant.tensor import QuantizedData, Usage

Axes = tuple[str, ...]


def _uses_kernel(quantizer: BaseQuantizer, shard: jax.Array, backend: Backend) -> bool:
  """The cast kernel where it runs and takes the shard (ops.quantize's rule, on the shard)."""
  if not backend.binds("quantize_usages"):
    return False
  reason = unsupported_reason(quantizer, *shard.shape, shard.dtype)
  if reason and backend.choice == "kernel":
    raise ValueError(f"implementation='kernel': {reason} (a shard of the sharded matrix)")
  return reason is None


def _amax(shard, *, use_kernel: bool, per_row: bool = False, rht: bool = False):
  """This shard's amax: per tensor, per row, or of its RHT'd columnwise data; the amax
  kernel's where the cast is the kernel's and the amax kernel is not disabled."""
  if use_kernel:
    return kernels.amax(shard, per_row=per_row, rht=rht)
  values = fp32.widen(shard)
  if rht:
    return fp32.abs_max(hadamard.apply_rht(values.T, shard.dtype))
  return fp32.abs_max(values, axis=1 if per_row else None)


def _nvfp4_amaxes(
  shard, q: NVFP4Quantizer, usages, row_axes: Axes, col_axes: Axes, use_kernel: bool
):
  """(rowwise, columnwise) global amaxes, as `kernels.quantize.nvfp4_amaxes` takes them
  from the whole matrix."""
  every_axis = row_axes + col_axes
  row = col = jnp.zeros((), jnp.float32)
  tensor = None
  if "rowwise" in usages:
    # Per-token amaxes are per row: only the shards of one row (its cols) reduce.
    row = pmax_amax(
      _amax(shard, use_kernel=use_kernel, per_row=q.per_token),
      col_axes if q.per_token else every_axis,
    )
    # The tensor amax of per-token data: the max of the rows' amaxes, over every row's shard.
    tensor = pmax_amax(fp32.abs_max(row), row_axes) if q.per_token else row
  if "columnwise" in usages:
    if q.rht and not q.tile_2d:
      col = pmax_amax(_amax(shard, use_kernel=use_kernel, rht=True), every_axis)
    else:
      col = (
        tensor if tensor is not None else pmax_amax(_amax(shard, use_kernel=use_kernel), every_axis)
      )
  if q.tile_2d and "rowwise" not in usages:
    row = col  # 16x16 tiles take their scales from the (shared) tensor amax
  return row, col


def cast_shard(
  shard: jax.Array,
  quantizer: BaseQuantizer,
  usages: tuple[Usage, ...],
  *,
  row_axes: Axes,
  col_axes: Axes,
  backend: Backend,
  scale: Optional[jax.Array] = None,
):
  """Quantizes this device's shard of a [M, K] matrix for `usages` (in the matrix's
  rowwise / columnwise layouts), as the whole matrix's cast does on this shard.

  `row_axes` / `col_axes`: the mesh axes splitting the matrix's rows and cols (the amaxes
  reduce over them). `backend`: the choice of kernels (ops/_backend.py). `scale`: delayed
  scaling's scale. Returns `({usage: QuantizedData of the shard}, recorded)`, `recorded`
  the whole matrix's amax for delayed scaling, else None.
  """
  if getattr(quantizer, "stochastic_rounding", False):
    raise ValueError(
      f"{quantizer!r}: a shard cannot draw its part of the whole matrix's "
      "stochastic-rounding stream"
    )
  use_kernel = _uses_kernel(quantizer, shard, backend)
  use_amax_kernel = use_kernel and backend.binds("amax")
  every_axis = row_axes + col_axes
  zero = jnp.zeros((), jnp.float32)
  row_amax = col_amax = zero
  recorded = None
  if isinstance(quantizer, DelayedFloat8Quantizer):
    row_amax = col_amax = scale
  elif isinstance(quantizer, Float8Quantizer):
    row_amax = col_amax = pmax_amax(_amax(shard, use_kernel=use_amax_kernel), every_axis)
  elif isinstance(quantizer, NVFP4Quantizer):
    row_amax, col_amax = _nvfp4_amaxes(
      shard, quantizer, usages, row_axes, col_axes, use_amax_kernel
    )
  config = cast_config(quantizer, usages)
  cast = (
    functools.partial(cast_p.bind, config=config)
    if use_kernel
    else functools.partial(reference_cast, config=config)
  )
  # No stochastic rounding: the seed operand is an unread scalar.
  outs = cast(shard, row_amax, col_amax, jnp.zeros((), jnp.uint32))
  result = {}
  for i, usage in enumerate(config.usages):
    global_amax = None
    if isinstance(quantizer, NVFP4Quantizer):
      global_amax = row_amax if usage == "rowwise" else col_amax
    result[usage] = QuantizedData(
      outs[2 * i], outs[2 * i + 1], global_amax, config.usage_format(usage)
    )
  if config.observe_amax:  # this shard's amax, from the cast: the matrix's is their max
    recorded = pmax_amax(outs[-1], every_axis)
  return result, recorded
