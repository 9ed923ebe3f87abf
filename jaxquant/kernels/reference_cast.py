"""The cast primitive's lowering off CUDA: the reference, with the global amaxes given.

The reference (jaxquant.reference) computes each usage's global amax itself; the cast
primitive receives it as an input (global under sharding). Per-tensor FP8, MXFP8 and
block FP8 reuse the reference functions unchanged; NVFP4 needs the reference's
`nvfp4.quantize` with the amax passed in, written here from the reference's own pieces.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxquant.formats import Family, Format
from jaxquant.reference import elements, fp32, fp8, hadamard, mxfp8, nvfp4
from jaxquant.reference.blocks import block_reduce, expand_blocks
from jaxquant.tensor import QuantizedData

USAGE_INDEX = {"rowwise": 0, "columnwise": 1}


def _nvfp4_with_amax(x, fmt: Format, amax, random_bits) -> QuantizedData:
  """reference.nvfp4.quantize with the global amax (scalar or [rows]) given.

  Kept line for line in step with reference/nvfp4.py (test_reference_lowering_matches_
  reference checks it); it goes away once the reference takes the amax as an argument.
  """
  rows, _ = x.shape
  s_enc, s_dec = nvfp4.global_scales(amax)
  if fmt.row_scaled:
    s_enc, s_dec = s_enc.reshape(rows, 1), s_dec.reshape(rows, 1)
  block_amax = block_reduce(x, fmt.block, fp32.abs_max)
  scale_codes = elements.encode(
      fp32.mul(block_amax, s_enc * jnp.float32(nvfp4._ONE_SIXTH)), "e4m3")
  s = elements.decode(scale_codes, "e4m3")
  enc = jnp.minimum(fp32.div(jnp.float32(1.0), fp32.mul(s, s_dec)), nvfp4._FLT_MAX)
  enc = jnp.where(s == 0, jnp.float32(0.0), enc)
  y = fp32.mul_for_encoding(x, expand_blocks(enc, fmt.block, x.shape))
  codes = (elements.encode(y, "e2m1") if random_bits is None
           else nvfp4._encode_stochastic(y, random_bits))
  scale = jax.lax.bitcast_convert_type(scale_codes, jnp.float8_e4m3fn)
  return QuantizedData(elements.pack_nibbles(codes), scale, amax, fmt)


def sr_bits(seed, usage: str, shape) -> jax.Array:
  """The reference's random bits for a usage: the same stream as reference.quantize when
  `seed` is the data of a threefry key."""
  key = jax.random.wrap_key_data(seed, impl="threefry2x32")
  return jax.random.bits(jax.random.fold_in(key, USAGE_INDEX[usage]), shape, jnp.uint8)


def reference_cast(x, row_amax, col_amax, seed, *, config):
  dtype = x.dtype
  x2d = x.astype(jnp.float32)
  out = []
  for usage in config.usages:
    fmt = config.usage_format(usage)
    stored = x2d if usage == "rowwise" else x2d.T
    family = fmt.family
    if family is Family.FP8_TENSOR:
      scale = row_amax if config.given_scale else fp8.scale_from_amax(
          row_amax, fmt.fmax, eps=config.eps, pow2=config.pow2_scales, input_dtype=dtype)
      qd = fp8.quantize_with_scale(stored, scale, fmt)
    elif family is Family.FP8_BLOCK:
      qd = fp8.quantize_block(stored, fmt, eps=config.eps, pow2=config.pow2_scales,
                              input_dtype=dtype)
    elif family is Family.MXFP8:
      qd = mxfp8.quantize(stored, fmt)
    else:
      if config.rht and usage == "columnwise":
        stored = hadamard.apply_rht(stored, dtype)
      bits = sr_bits(seed, usage, stored.shape) if config.stochastic_rounding else None
      qd = _nvfp4_with_amax(stored, fmt, row_amax if usage == "rowwise" else col_amax, bits)
    out += [qd.data, qd.scale_inv]
  return out
