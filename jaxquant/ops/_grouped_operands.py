"""The operands of grouped_dense's GEMMs: one usage of x, dy or the experts' weights.

A `GroupedOperand` is what a grouped GEMM consumes: values in a narrow dtype that holds
them exactly (`exact`: the FP8 codes of per-tensor FP8, bf16 for values exact in bf16), or
fp32 values that no narrow dtype holds (those run on the reference's ragged products); the
per-group decode scale that factors out of each group's products; a per-row one where a
format has it (NVFP4 per token); and the rows' group layout.

Per-tensor FP8 (current and delayed scaling) is cast here from the input as it comes (bf16
activations, the weights' own dtype): the per-group amax is one reduction over the input,
the codes one elementwise pass, so no fp32 copy of an activation is made and the codes are
what is kept for backward. These are the reference's own functions (`reference.grouped`
per group, NUMERICS.md per tensor), applied to each group: the codes are the reference's
bit for bit (tests/ops/test_grouped_operands.py). Every other format takes
`reference.grouped.quantize_rows` / `quantize_experts`, which dequantize to fp32 values.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from jaxquant.formats import Family
from jaxquant.quantizers import DelayedFloat8Quantizer, Float8Quantizer, Quantizer, for_usage
from jaxquant.reference import _fp8 as fp8
from jaxquant.reference import _fp32 as fp32
from jaxquant.reference import _grouped as ref
from jaxquant.reference._grouped import GroupLayout

_FP8_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


@dataclasses.dataclass(frozen=True)
class GroupedOperand:
  """One usage of a grouped GEMM operand.

  values: [rows, C] (activations, gradients) or [G, R, C] (weights), in `exact` where that
    is a narrow dtype, else fp32.
  group_scale: [G] or None: multiplies every product of the group.
  row_scale: [rows] or None: multiplies every product of the row (rowwise NVFP4 per token).
  layout: the rows' groups (activations only; padded for RHT'd data).
  exact: the narrow dtype holding the values exactly (FP8 codes, bf16), or None.
  """

  values: jax.Array
  group_scale: Optional[jax.Array]
  row_scale: Optional[jax.Array]
  layout: Optional[GroupLayout]
  exact: Optional[jnp.dtype]


jax.tree_util.register_dataclass(
  GroupedOperand,
  data_fields=["values", "group_scale", "row_scale", "layout"],
  meta_fields=["exact"],
)


def _per_tensor_fp8(q: Optional[Quantizer]) -> bool:
  return isinstance(q, (Float8Quantizer, DelayedFloat8Quantizer))


def _fp8_scale(q, amax, delayed_scale, input_dtype):
  """NUMERICS.md per-tensor FP8 steps 1-3 on each group's amax, or the delayed scale."""
  if isinstance(q, DelayedFloat8Quantizer):
    return delayed_scale
  fmt = q.format("rowwise")
  return fp8.scale_from_amax(amax, fmt.fmax, eps=q.eps, pow2=q.pow2_scales, input_dtype=input_dtype)


def _exact_dtype(q: Optional[Quantizer], usage: str, input_dtype) -> Optional[jnp.dtype]:
  """The narrow dtype holding the values of one usage exactly (see ops.grouped_gemm)."""
  if q is None:
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(input_dtype) == jnp.bfloat16 else None
  fmt = q.format(usage)
  if fmt.family is Family.FP8_TENSOR:
    return jnp.dtype(_FP8_DTYPES[fmt.element])
  if fmt.family is Family.FP8_BLOCK and not fmt.pow2_scales:
    return None
  return jnp.dtype(jnp.bfloat16)


def quantize_rows(
  x: jax.Array,
  layout: GroupLayout,
  quantizer: Optional[Quantizer],
  usage: str,
  *,
  what: str,
  delayed_scale: Optional[jax.Array] = None,
  key: Optional[jax.Array] = None,
):
  """One usage of a grouped activation or gradient x [rows, C] in its own dtype.

  Returns (GroupedOperand, per-group amax [G] or None: what delayed scaling records).
  Rows of no group may hold anything: every GEMM ignores them.
  """
  q = for_usage(quantizer, usage)
  exact = _exact_dtype(q, usage, x.dtype)
  if _per_tensor_fp8(q):
    x32 = fp32.widen(x)  # elementwise: XLA fuses it into the reduction and the cast
    amax = ref.group_abs_max(x32, layout)
    scale = _fp8_scale(q, amax, delayed_scale, x.dtype)
    codes = fp8.cast(x32, scale[layout.row_gather_ids()][:, None], q.format(usage).element)
    recorded = amax if isinstance(q, DelayedFloat8Quantizer) else None
    return GroupedOperand(codes, fp32.div(jnp.float32(1.0), scale), None, layout, exact), recorded
  if q is None and exact is not None:  # unquantized bf16: the values as they are
    return GroupedOperand(x, None, None, layout, exact), None
  x32 = jnp.where(layout.row_mask()[:, None], fp32.widen(x), 0.0)
  values, amax = ref.quantize_rows(
    x32,
    layout,
    quantizer,
    usage,
    input_dtype=x.dtype,
    what=what,
    delayed_scale=delayed_scale,
    key=key,
  )
  group_scale, row_scale = None, None
  if values.outer is not None and usage == "columnwise":
    group_scale = values.outer
  elif values.outer is not None:
    row_scale = values.outer
  return GroupedOperand(values.values, group_scale, row_scale, values.layout, exact), amax


def quantize_experts(
  kernel: jax.Array,
  quantizer: Optional[Quantizer],
  usage: str,
  *,
  delayed_scale: Optional[jax.Array] = None,
  key: Optional[jax.Array] = None,
):
  """One usage of the experts' weights, from the [G, K, N] kernel (each expert's w is
  [N, K]). Values in the usage's stored layout: rowwise [G, N, K], columnwise [G, K, N].

  Returns (GroupedOperand without layout, per-expert amax [G] or None).
  """
  q = for_usage(quantizer, usage)
  exact = _exact_dtype(q, usage, kernel.dtype)
  stored = jnp.swapaxes(kernel, 1, 2) if usage == "rowwise" else kernel
  if _per_tensor_fp8(q):
    w32 = fp32.widen(stored)
    amax = fp32.abs_max(w32.reshape(w32.shape[0], -1), axis=1)
    scale = _fp8_scale(q, amax, delayed_scale, kernel.dtype)
    codes = fp8.cast(w32, scale[:, None, None], q.format(usage).element)
    recorded = amax if isinstance(q, DelayedFloat8Quantizer) else None
    return GroupedOperand(codes, fp32.div(jnp.float32(1.0), scale), None, None, exact), recorded
  if q is None and exact is not None:
    return GroupedOperand(stored, None, None, None, exact), None
  values, outer, amax = ref.quantize_experts(
    jnp.swapaxes(kernel, 1, 2), quantizer, usage, delayed_scale=delayed_scale, key=key
  )
  return GroupedOperand(values, outer, None, None, exact), amax


def scaled_values(op: GroupedOperand) -> GroupedOperand:
  """The operand with its scales applied: fp32 values that are no longer codes (the
  "dequantized" backward's weights and activations)."""
  values = op.values.astype(jnp.float32)
  if op.group_scale is not None:
    scale = op.group_scale
    if op.layout is None:  # weights: one scale per expert
      values = values * scale[:, None, None]
    else:
      values = values * scale[op.layout.row_gather_ids()][:, None]
  if op.row_scale is not None:
    values = values * op.row_scale[:, None]
  return GroupedOperand(values, None, None, op.layout, None)
