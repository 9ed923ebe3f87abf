"""Quantize through the kernels: amaxes first, then one cast for both usages.

`quantize_usages` is the kernel-side counterpart of one base quantizer's part of
`jaxquant.reference.quantize`: same validation, same `QuantizedData` layouts and bits
(SR aside), built from the amax and cast primitives.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxquant.formats import Family
from jaxquant.kernels._amax import amax as amax_kernel
from jaxquant.kernels._amax import tensor_amax
from jaxquant.kernels._cast import cast_p, stored_shape
from jaxquant.kernels._config import CastConfig, cast_config, unsupported_reason
from jaxquant.kernels._reference_cast import reference_cast
from jaxquant.kernels._validate import check_array, check_matrix
from jaxquant.quantizers import BaseQuantizer, DelayedFloat8Quantizer, NVFP4Quantizer
from jaxquant.reference import _fp32 as fp32
from jaxquant.tensor import QuantizedData, Usage


def seed_from_key(key: jax.Array) -> jax.Array:
  """uint32[2] seeding the kernels' Philox stream: the key's own data for threefry keys
  (so the CPU lowering reproduces the reference's bits), derived bits otherwise."""
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    data = jax.random.key_data(key)
  else:
    data = key
  if data.shape == (2,) and data.dtype == jnp.uint32:
    return data
  return jax.random.bits(key, (2,), jnp.uint32)


def cast_seed(config: CastConfig, key: Optional[jax.Array]) -> jax.Array:
  """The cast's seed operand: the key's uint32[2] with stochastic rounding (the key is then
  required), else an unread scalar (XLA embeds a scalar constant, while a uint32[2] of
  zeros costs a broadcast kernel before every cast)."""
  if not config.stochastic_rounding:
    return jnp.zeros((), jnp.uint32)
  return seed_from_key(key)


def quantize_usages(
  x2d: jax.Array,
  quantizer: BaseQuantizer,
  usages: tuple[Usage, ...],
  *,
  key: Optional[jax.Array] = None,
  scale: Optional[jax.Array] = None,
) -> dict[Usage, QuantizedData]:
  """Quantizes a [M, K] matrix for `usages` with one base quantizer, in one cast.

  `scale` is the delayed-scaling scale (DelayedFloat8Quantizer); `key` the SR key.
  Raises ValueError for inputs no kernel takes (the caller may use the reference).
  """
  return quantize_usages_and_amax(x2d, quantizer, usages, key=key, scale=scale)[0]


def quantize_usages_and_amax(
  x2d: jax.Array,
  quantizer: BaseQuantizer,
  usages: tuple[Usage, ...],
  *,
  key: Optional[jax.Array] = None,
  scale: Optional[jax.Array] = None,
):
  """`quantize_usages`, plus the amax of x2d that delayed scaling records: taken by the
  cast as it reads x2d, not by a pass of its own (None for the other quantizers)."""
  check_matrix(x2d, f"{type(quantizer).__name__} kernel")
  m, k = x2d.shape
  for usage in usages:
    rows, cols = stored_shape(usage, m, k)
    quantizer.format(usage).check_dims(rows, cols, f"{usage} usage of a [{m}, {k}] matrix")
  reason = unsupported_reason(quantizer, m, k, x2d.dtype)
  if reason:
    raise ValueError(reason)
  row_amax, col_amax = cast_amaxes(x2d, quantizer, usages, scale=scale)
  return cast(x2d, quantizer, usages, row_amax, col_amax, key=key)


def cast_amaxes(x2d: jax.Array, quantizer: BaseQuantizer, usages, *, scale=None):
  """The cast's two scalar operands (rowwise, columnwise): per-tensor FP8's amax, or the
  delayed-scaling `scale`; NVFP4's global amaxes (per row with per-token scaling); unread
  zeros for the other families."""
  family = quantizer.format("rowwise").family
  zero = jnp.zeros((), jnp.float32)
  if family is Family.FP8_TENSOR:
    if isinstance(quantizer, DelayedFloat8Quantizer):
      if scale is None:
        raise ValueError("DelayedFloat8Quantizer: the kernel needs the state's scale")
      check_array(scale, "delayed scale", (), jnp.float32)
      return scale, scale
    amax = tensor_amax(x2d)
    return amax, amax
  if family is Family.NVFP4:
    return nvfp4_amaxes(x2d, quantizer, usages)
  return zero, zero


def cast(
  x2d: jax.Array,
  quantizer: BaseQuantizer,
  usages: tuple[Usage, ...],
  row_amax: jax.Array,
  col_amax: jax.Array,
  *,
  key: Optional[jax.Array] = None,
  implementation: str = "kernel",
):
  """The cast alone, its scalar operands given (`cast_amaxes`): ({usage: QuantizedData},
  the input's amax where the config observes it, else None). `implementation="reference"`
  runs the cast's pure-JAX lowering on any platform instead of its primitive."""
  if implementation not in ("kernel", "reference"):
    raise ValueError(f"implementation={implementation!r}: must be 'kernel' or 'reference'")
  config = cast_config(quantizer, usages)
  family = config.format.family
  if config.stochastic_rounding and key is None:
    raise ValueError(f"{quantizer!r} rounds stochastically: pass a PRNG key as key=")
  seed = cast_seed(config, key)
  if implementation == "reference":
    outs = reference_cast(x2d, row_amax, col_amax, seed, config=config)
  else:
    outs = cast_p.bind(x2d, row_amax, col_amax, seed, config=config)
  result = {}
  for i, usage in enumerate(config.usages):
    global_amax = None
    if family is Family.NVFP4:
      global_amax = row_amax if usage == "rowwise" else col_amax
    result[usage] = QuantizedData(
      outs[2 * i], outs[2 * i + 1], global_amax, config.usage_format(usage)
    )
  return result, (outs[-1] if config.observe_amax else None)


def nvfp4_amaxes(x2d, q: NVFP4Quantizer, usages):
  """(rowwise, columnwise) global amaxes, each computed at most once."""
  row = col = jnp.zeros((), jnp.float32)
  tensor = None
  if "rowwise" in usages:
    row = amax_kernel(x2d, per_row=True) if q.per_token else tensor_amax(x2d)
    tensor = fp32.abs_max(row) if q.per_token else row
  if "columnwise" in usages:
    if q.rht and not q.tile_2d:
      col = amax_kernel(x2d, rht=True)
    else:
      col = tensor if tensor is not None else tensor_amax(x2d)
  if q.tile_2d and "rowwise" not in usages:
    row = col  # 16x16 tiles take their scales from the (shared) tensor amax
  return row, col
