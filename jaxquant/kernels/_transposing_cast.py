"""Per-tensor FP8 of both usages with the tensor's values read once, by the op that makes it.

The cast kernel (kernels/_cast.py) reads a tensor its producer has just written: 2 bytes in
and 2 out per element, in a pass of its own, since a custom call cannot be fused. Here the
rowwise codes are XLA code instead, which XLA fuses into the producer (a norm, an
activation, a residual add, a backward fusion making a gradient): the producer writes 1
more byte per element and the tensor's amax comes from the same fusion
(`tensor_amax`). The columnwise codes are those codes transposed (`transpose_codes`, 1 byte
in and 1 out): per-tensor FP8 has one scale, so the columnwise usage is exactly the
rowwise codes transposed. The bits are the reference's: `fp8_codes` is checked against
`reference.fp8.cast` bit for bit (tests/kernels/test_transposing_cast.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxquant.formats import ELEMENT_DTYPES, Format
from jaxquant.kernels._amax import tensor_amax
from jaxquant.kernels._transpose import transpose_codes
from jaxquant.quantizers import DelayedFloat8Quantizer, Float8Quantizer
from jaxquant.reference import _elements as elements
from jaxquant.reference import _fp8 as fp8
from jaxquant.reference import _fp32 as fp32
from jaxquant.tensor import QuantizedData, Usage

# The NaN code of each element (NUMERICS.md): XLA's convert would give another.
_NAN_CODE = {"e4m3": 0x7F, "e5m2": 0x7E}


def fp8_codes(x: jax.Array, scale: jax.Array, fmt: Format) -> jax.Array:
  """`reference.fp8.cast(x, scale, element)` as XLA's convert: x * scale in fp32 (of x's own
  values, `fp32.widen`), saturated to the format's largest value (the convert itself would
  overflow to NaN), NaN as the format's NaN code."""
  y = jnp.clip(fp32.widen(x) * scale, -fmt.fmax, fmt.fmax)  # NaN passes through
  codes = elements.dtype_to_codes(y.astype(ELEMENT_DTYPES[fmt.element]))
  codes = jnp.where(jnp.isnan(y), jnp.uint8(_NAN_CODE[fmt.element]), codes)
  return elements.codes_to_dtype(codes, fmt.element)


def quantize_transposing(
  x2d: jax.Array,
  quantizer: Float8Quantizer | DelayedFloat8Quantizer,
  usages: tuple[Usage, ...],
  *,
  scale: jax.Array | None = None,
):
  """({usage: QuantizedData}, the amax delayed scaling records or None): the bits of the
  cast kernel's per-tensor FP8 cast, its rowwise codes fused into x2d's producer and its
  columnwise codes their transpose. `scale` is the delayed-scaling scale."""
  fmt = quantizer.format("rowwise")
  amax = tensor_amax(x2d)
  if isinstance(quantizer, DelayedFloat8Quantizer):
    observed = amax
  else:
    observed = None
    scale = fp8.scale_from_amax(
      amax, fmt.fmax, eps=quantizer.eps, pow2=quantizer.pow2_scales, input_dtype=x2d.dtype
    )
  scale_inv = fp32.div(jnp.float32(1.0), scale)
  rowwise = fp8_codes(x2d, scale, fmt)
  out = {}
  if "rowwise" in usages:
    out["rowwise"] = QuantizedData(rowwise, scale_inv, None, fmt)
  if "columnwise" in usages:
    out["columnwise"] = QuantizedData(
      transpose_codes(rowwise), scale_inv, None, quantizer.format("columnwise")
    )
  return out, observed
