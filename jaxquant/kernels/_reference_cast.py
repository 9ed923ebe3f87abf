"""The cast primitive's lowering off CUDA: the reference, with the global amaxes given.

The reference (jaxquant.reference) computes each usage's global amax itself; the cast
primitive receives it as an input (global under sharding) and hands it to the reference
functions, so this lowering is the reference itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxquant.formats import Family
from jaxquant.reference import _fp8 as fp8
from jaxquant.reference import _fp32 as fp32
from jaxquant.reference import _hadamard as hadamard
from jaxquant.reference import _mxfp8 as mxfp8
from jaxquant.reference import _nvfp4 as nvfp4

USAGE_INDEX = {"rowwise": 0, "columnwise": 1}


def sr_bits(seed, usage: str, shape) -> jax.Array:
  """The reference's random bits for a usage: the same stream as reference.quantize when
  `seed` is the data of a threefry key."""
  key = jax.random.wrap_key_data(seed, impl="threefry2x32")
  return nvfp4.random_bits(jax.random.fold_in(key, USAGE_INDEX[usage]), shape)


def reference_cast(x, row_amax, col_amax, seed, *, config):
  dtype = x.dtype
  x2d = x.astype(jnp.float32)
  out = []
  for usage in config.usages:
    fmt = config.usage_format(usage)
    stored = x2d if usage == "rowwise" else x2d.T
    family = fmt.family
    if family is Family.FP8_TENSOR:
      scale = (
        row_amax
        if config.given_scale
        else fp8.scale_from_amax(
          row_amax, fmt.fmax, eps=config.eps, pow2=config.pow2_scales, input_dtype=dtype
        )
      )
      qd = fp8.quantize_with_scale(stored, scale, fmt)
    elif family is Family.FP8_BLOCK:
      qd = fp8.quantize_block(
        stored, fmt, eps=config.eps, pow2=config.pow2_scales, input_dtype=dtype
      )
    elif family is Family.MXFP8:
      qd = mxfp8.quantize(stored, fmt)
    else:
      if config.rht and usage == "columnwise":
        stored = hadamard.apply_rht(stored, dtype)
      bits = sr_bits(seed, usage, stored.shape) if config.stochastic_rounding else None
      qd = nvfp4.quantize(
        stored, fmt, random_bits=bits, amax=row_amax if usage == "rowwise" else col_amax
      )
    out += [qd.data, qd.scale_inv]
  if config.observe_amax:
    out.append(fp32.abs_max(x2d))
  return out
