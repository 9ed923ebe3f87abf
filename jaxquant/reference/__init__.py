"""The pure-JAX reference: NUMERICS.md turned into code. It defines the numbers.

`quantize` produces a `QuantizedTensor` for the requested usages of any quantizer;
`dequantize` undoes it. Kernels must produce the same bits.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.formats import INPUT_DTYPES, Family
from jaxquant.quantizers import (
  QUANTIZER_TYPES,
  BlockFloat8Quantizer,
  DelayedFloat8Quantizer,
  Float8Quantizer,
  MXFP8Quantizer,
  NVFP4Quantizer,
  Quantizer,
  for_usage,
  needs_key,
  needs_state,
)
from jaxquant.reference import _fp8 as fp8
from jaxquant.reference import _fp32 as fp32
from jaxquant.reference import _hadamard as hadamard
from jaxquant.reference import _mxfp8 as mxfp8
from jaxquant.reference import _nvfp4 as nvfp4
from jaxquant.reference import _scaling as scaling
from jaxquant.reference._elements import decode, unpack_nibbles
from jaxquant.reference._hadamard import apply_rht
from jaxquant.tensor import QuantizedData, QuantizedTensor, Usage, check_usages

__all__ = [
  "apply_rht",
  "decode",
  "unpack_nibbles",
  "quantize",
  "dequantize",
  "dequantize_data",
  "split_scales",
  "outer_scale",
  "outer_scales",
  "check_input",
  "check_delayed_state",
]


def check_input(x, quantizer) -> None:
  """Trace-time validation shared by every backend."""
  if not isinstance(quantizer, QUANTIZER_TYPES):
    raise TypeError(f"quantizer must be a jaxquant quantizer, got {quantizer!r}")
  if jnp.ndim(x) == 0:
    raise ValueError("cannot quantize a rank-0 tensor: quantization needs a last (K) dim")
  if jnp.dtype(x.dtype) not in INPUT_DTYPES:
    raise TypeError(f"input dtype must be one of bfloat16, float16, float32, got {x.dtype}")


def check_delayed_state(quantizer: Quantizer, state) -> None:
  """A delayed-scaling quantizer's state is given and fits one tensor (`scaling.check_state`)."""
  if not needs_state(quantizer):
    return
  if state is None:
    raise ValueError(f"{quantizer!r} uses delayed scaling: pass its DelayedScalingState as state=")
  scaling.check_state(state)


def _stored_matrix(x2d, usage: Usage):
  return x2d if usage == "rowwise" else x2d.T


def quantize(
  x: jax.Array,
  quantizer: Quantizer,
  usages=("rowwise", "columnwise"),
  *,
  key: Optional[jax.Array] = None,
  state: Optional[scaling.DelayedScalingState] = None,
):
  """Quantizes `x` ([..., K], viewed as [M, K]) for the given usages.

  Returns a `QuantizedTensor`; with delayed scaling (which needs `state`) returns
  `(QuantizedTensor, new_state)` where new_state has this tensor's amax recorded.
  `key` is needed when the quantizer rounds stochastically.
  """
  check_input(x, quantizer)
  usages = check_usages(usages)
  check_delayed_state(quantizer, state)
  if any(needs_key(for_usage(quantizer, u)) for u in usages) and key is None:
    raise ValueError(f"{quantizer!r} rounds stochastically: pass a PRNG key as key=")
  shape, dtype = tuple(x.shape), jnp.dtype(x.dtype)
  # [M, K] with M spelled out: an empty K leaves -1 undetermined.
  x_matrix = x.reshape(math.prod(shape[:-1]), shape[-1])
  x2d = fp32.widen(x_matrix)
  slots, new_state = {}, state
  for usage in usages:
    q = for_usage(quantizer, usage)
    stored = _stored_matrix(x2d, usage)
    if q is None:
      slots["hp_" + usage] = _stored_matrix(x_matrix, usage)
      continue
    fmt = q.format(usage)
    fmt.check_dims(
      *stored.shape,
      what=f"{usage} usage of a {shape} tensor "
      f"(stored {'[M, K]' if usage == 'rowwise' else '[K, M]'} = {list(stored.shape)})",
    )
    if isinstance(q, Float8Quantizer):
      amax = fp32.abs_max(x2d)
      scale = fp8.scale_from_amax(amax, fmt.fmax, eps=q.eps, pow2=q.pow2_scales, input_dtype=dtype)
      slots[usage] = fp8.quantize_with_scale(stored, scale, fmt)
    elif isinstance(q, DelayedFloat8Quantizer):
      slots[usage] = fp8.quantize_with_scale(stored, state.scale, fmt)
      if new_state is state:  # both usages share one tensor amax: record it once
        new_state = scaling.record_amax(state, fp32.abs_max(x2d))
    elif isinstance(q, BlockFloat8Quantizer):
      slots[usage] = fp8.quantize_block(
        stored, fmt, eps=q.eps, pow2=q.pow2_scales, input_dtype=dtype
      )
    elif isinstance(q, MXFP8Quantizer):
      slots[usage] = mxfp8.quantize(stored, fmt)
    elif isinstance(q, NVFP4Quantizer):
      if q.rht and usage == "columnwise":
        stored = hadamard.apply_rht(stored, dtype)
      bits = None
      if q.stochastic_rounding:
        usage_key = jax.random.fold_in(key, 0 if usage == "rowwise" else 1)
        bits = nvfp4.random_bits(usage_key, stored.shape)
      slots[usage] = nvfp4.quantize(stored, fmt, random_bits=bits)
  qt = QuantizedTensor(shape=shape, dtype=dtype, **slots)
  return (qt, new_state) if state is not None else qt


def outer_scale(qd: QuantizedData):
  """The decode scale that factors out of a GEMM: the per-tensor FP8 scale_inv, the NVFP4
  S_dec (a scalar, or [rows] for per-token data), or None."""
  family = qd.format.family
  if family is Family.FP8_TENSOR:
    return qd.scale_inv
  if family is Family.NVFP4:
    return nvfp4.decode_scale(qd)
  return None


def outer_scales(*operands, s_dec_of: Optional[Callable[[jax.Array], jax.Array]] = None):
  """`outer_scale` of each operand (None for one that is not quantized), the NVFP4 S_decs
  from one computation over all their amaxes: `s_dec_of(amaxes)`, by default the exact
  `nvfp4.global_scales` (the GPU GEMMs pass the kernel). Its exact fp32 divisions are
  integer emulations on GPUs, and a copy per operand of every GEMM multiplied a step's
  compile time. The arithmetic is elementwise, so each S_dec has the bits `outer_scale`
  gives it."""
  is_nvfp4 = [isinstance(op, QuantizedData) and op.format.family is Family.NVFP4 for op in operands]
  amaxes = [op.amax for op, nv in zip(operands, is_nvfp4, strict=False) if nv]
  s_decs = iter(())
  if amaxes:
    s_dec_of = s_dec_of or (lambda amax: nvfp4.global_scales(amax)[1])
    flat = s_dec_of(jnp.concatenate([jnp.ravel(a) for a in amaxes]))
    s_decs = iter(jnp.split(flat, list(np.cumsum([a.size for a in amaxes[:-1]]))))
  return tuple(
    next(s_decs).reshape(op.amax.shape)
    if nv
    else outer_scale(op)
    if isinstance(op, QuantizedData)
    else None
    for op, nv in zip(operands, is_nvfp4, strict=False)
  )


def split_scales(qd: QuantizedData):
  """(values with block scales applied [rows, cols] fp32, `outer_scale(qd)`)."""
  family = qd.format.family
  if family in (Family.FP8_TENSOR, Family.FP8_BLOCK):
    values = fp8.dequantize_values(qd)
  elif family is Family.MXFP8:
    values = mxfp8.dequantize_values(qd)
  else:
    values = nvfp4.dequantize_values(qd)
  return values, outer_scale(qd)


def dequantize_data(qd: QuantizedData) -> jax.Array:
  """One usage back to fp32, in its stored layout."""
  values, outer = split_scales(qd)
  if outer is None:
    return values
  return fp32.mul(values, outer.reshape(-1, 1) if outer.ndim else outer)


def dequantize(qt: QuantizedTensor, usage: Usage = "rowwise", dtype=None) -> jax.Array:
  """A usage of a QuantizedTensor back to its logical shape, in `dtype` (default: original)."""
  stored = qt.usage(usage)
  if stored is None:
    raise ValueError(f"this QuantizedTensor holds no {usage} usage")
  matrix = dequantize_data(stored) if isinstance(stored, QuantizedData) else stored
  if usage == "columnwise":
    matrix = matrix.T
  return matrix.reshape(qt.shape).astype(dtype or qt.dtype)
