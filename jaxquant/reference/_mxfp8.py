"""MXFP8: E8M0 scale per 32 elements, rounded up to a power of two (NUMERICS.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.formats import Format
from jaxquant.reference import _elements as elements
from jaxquant.reference import _fp32 as fp32
from jaxquant.reference._blocks import block_reduce, expand_blocks
from jaxquant.tensor import QuantizedData


def scale_exponent(block_amax: jax.Array, fmax: float) -> jax.Array:
  """The stored E8M0 byte e for each block: t = b / fmax rounded up to 2^(e-127)."""
  t = fp32.mul(block_amax, jnp.float32(np.float32(1.0) / np.float32(fmax)))
  u = fp32.bits(t)
  field = (u >> 23) & 0xFF
  frac = u & np.uint32(0x7FFFFF)
  round_up = (frac > 0) & (field != 0xFE) & ~((field == 0) & (frac <= 0x400000))
  e = field + round_up.astype(jnp.uint32)
  e = jnp.where(jnp.isinf(t), jnp.uint32(0xFE), e)
  return jnp.where(fp32.is_nan(t), jnp.uint32(0xFF), e).astype(jnp.uint8)


def quantize(x: jax.Array, fmt: Format) -> QuantizedData:
  e = scale_exponent(block_reduce(x, fmt.block, fp32.abs_max), fmt.fmax)
  inv_scale = fp32.exp2(127 - expand_blocks(e, fmt.block, x.shape).astype(jnp.int32))
  codes = elements.encode(fp32.mul_for_encoding(x, inv_scale), fmt.element)
  scale = jax.lax.bitcast_convert_type(e, jnp.float8_e8m0fnu)
  return QuantizedData(elements.codes_to_dtype(codes, fmt.element), scale, None, fmt)


def dequantize_values(qd: QuantizedData) -> jax.Array:
  """x = q * 2^(e - 127); a NaN scale byte (0xFF) gives NaN."""
  values = elements.decode(elements.dtype_to_codes(qd.data), qd.format.element)
  e = jax.lax.bitcast_convert_type(qd.scale_inv, jnp.uint8).astype(jnp.int32)
  e = expand_blocks(e, qd.format.block, values.shape)
  out = fp32.mul(values, fp32.exp2(jnp.minimum(e, 254) - 127))
  return jnp.where(e == 0xFF, jnp.float32(jnp.nan), out)
