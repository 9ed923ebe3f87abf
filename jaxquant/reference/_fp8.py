"""FP8 with fp32 scales: per-tensor (current and delayed scaling) and block FP8.

All functions take one usage's stored matrix `[rows, cols]` (already transposed for the
columnwise usage) in fp32, plus `input_dtype`, whose largest finite value replaces a
scale that overflows (NUMERICS.md, per-tensor FP8 step 2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.formats import Format
from jaxquant.reference import _elements as elements
from jaxquant.reference import _fp32 as fp32
from jaxquant.reference._blocks import block_reduce, expand_blocks
from jaxquant.tensor import QuantizedData

_POW2_MASK = np.uint32(0xFF800000)  # sign and exponent: clears the 23 mantissa bits


def scale_from_amax(amax, fmax: float, *, eps: float, pow2: bool, input_dtype) -> jax.Array:
  """NUMERICS.md per-tensor FP8 steps 1-3, elementwise over `amax`."""
  # Compare and select on the bits (amax is >= 0 or NaN and eps >= 0, so the uint32 order is
  # the float order): XLA CPU rewrites where(a < eps, eps, a) into max(a, eps), which
  # flushes a subnormal amax to zero, where step 1 needs it exact.
  eps_bits = fp32.bits(jnp.float32(eps))
  amax_bits = fp32.bits(amax)
  a = fp32.from_bits(jnp.where(amax_bits < eps_bits, eps_bits, amax_bits))
  scale = fp32.div(jnp.float32(fmax), a)
  value_for_inf = jnp.float32(jnp.finfo(input_dtype).max)
  scale = jnp.where(jnp.isinf(scale), value_for_inf, scale)
  if pow2:
    scale = fp32.from_bits(fp32.bits(scale) & _POW2_MASK)
  return jnp.where(fp32.is_zero(a) | ~fp32.is_finite(a), jnp.float32(1.0), scale)


def cast(x, scale, element: str) -> jax.Array:
  """q = cvt_rne_satfinite(fl32(x * scale)), as the JAX float8 dtype."""
  return elements.codes_to_dtype(elements.encode(fp32.mul_for_encoding(x, scale), element), element)


def quantize_with_scale(x, scale, fmt: Format) -> QuantizedData:
  """Per-tensor FP8 with a given scale (current scaling computes it; delayed stores it)."""
  return QuantizedData(cast(x, scale, fmt.element), fp32.div(jnp.float32(1.0), scale), None, fmt)


def quantize_block(x, fmt: Format, *, eps: float, pow2: bool, input_dtype) -> QuantizedData:
  """Block FP8: the per-tensor formula on each block's amax; edge blocks may be partial."""
  amax = block_reduce(x, fmt.block, fp32.abs_max)
  scale = scale_from_amax(amax, fmt.fmax, eps=eps, pow2=pow2, input_dtype=input_dtype)
  data = cast(x, expand_blocks(scale, fmt.block, x.shape), fmt.element)
  return QuantizedData(data, fp32.div(jnp.float32(1.0), scale), None, fmt)


def dequantize_values(qd: QuantizedData) -> jax.Array:
  """Decoded FP8 values times their block scales (per-tensor scale left out)."""
  values = elements.decode(elements.dtype_to_codes(qd.data), qd.format.element)
  if qd.format.block == (0, 0):
    return values
  return fp32.mul(values, expand_blocks(qd.scale_inv, qd.format.block, values.shape))
