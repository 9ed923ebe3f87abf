"""Checkpoint names on what the quantized layers keep for their backward pass, and the
remat policy that keeps it.

Under `jax.checkpoint` (Flax: `nn.remat`, `nnx.remat`) a policy decides which values the
forward pass keeps; the backward pass recomputes the rest from them. `dense` and
`grouped_dense` name every array they leave for their backward GEMMs
`jaxquant.<role>_<kind>`, and their output `jaxquant.output`:

- `codes`: quantized data, FP8 codes or NVFP4's packed uint8 pairs (a byte a value or less);
- `scales`: the scales beside them, per tensor or per block, and NVFP4's global amax;
- `values`: a high-precision residual: the matrix itself (backward "high_precision", a
  hybrid's unquantized usage), or the bf16 values that a GEMM which dequantizes first
  multiplies (MXFP8 / NVFP4 "GEMM values", kernels.md).

Roles are "input" (the activation) and "weight"; the output gradient is never kept (it
exists in the backward pass alone).

`remat_policy()` keeps those residuals and the outputs: the backward GEMMs read the codes
the forward cast, and a value the backward of a non-GEMM op needs (an activation
function's input) is the saved output or recomputed from saved outputs, so no cast and no
GEMM of these layers runs again in the backward pass, and their inputs are kept as codes
(where the layer keeps codes, not values), not as bf16.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxquant.kernels._gemm_values import ScaledValues
from jaxquant.ops._grouped_operands import GroupedOperand
from jaxquant.tensor import QuantizedData

RESIDUAL_ROLES = ("input", "weight")
RESIDUAL_KINDS = ("codes", "scales", "values")
OUTPUT_NAME = "jaxquant.output"


def residual_name(role: str, kind: str) -> str:
  """The checkpoint name of one kind of a role's residual, e.g. "jaxquant.input_codes"."""
  if role not in RESIDUAL_ROLES or kind not in RESIDUAL_KINDS:
    raise ValueError(
      f"residual_name: role must be one of {RESIDUAL_ROLES} and kind one of "
      f"{RESIDUAL_KINDS}, got role={role!r}, kind={kind!r}"
    )
  return f"jaxquant.{role}_{kind}"


# Every name the layers put on a value, residuals first.
CHECKPOINT_NAMES = tuple(
  residual_name(role, kind) for role in RESIDUAL_ROLES for kind in RESIDUAL_KINDS
) + (OUTPUT_NAME,)


def _named(array: Optional[jax.Array], role: str, kind: str) -> Optional[jax.Array]:
  return None if array is None else checkpoint_name(array, residual_name(role, kind))


def tag_residual(residual, role: str):
  """`residual` (a pytree of operands: `QuantizedData`, `ScaledValues` or plain arrays)
  with each array named by its role and kind."""

  def tag(operand):
    if isinstance(operand, QuantizedData):
      return QuantizedData(
        _named(operand.data, role, "codes"),
        _named(operand.scale_inv, role, "scales"),
        _named(operand.amax, role, "scales"),
        operand.format,
      )
    if isinstance(operand, ScaledValues):
      return ScaledValues(
        _named(operand.values, role, "values"), _named(operand.amax, role, "scales")
      )
    return _named(operand, role, "values")

  return jax.tree_util.tree_map(
    tag, residual, is_leaf=lambda a: isinstance(a, (QuantizedData, ScaledValues))
  )


def tag_grouped_residual(operand: GroupedOperand, role: str) -> GroupedOperand:
  """A grouped operand with its values named codes (one byte a value or less: FP8 codes,
  packed NVFP4) or values (wider), and its group and row scales named scales. Its row
  layout is left unnamed: it is integer bookkeeping from the group sizes, recomputed."""
  kind = "codes" if jnp.dtype(operand.values.dtype).itemsize == 1 else "values"
  return dataclasses.replace(
    operand,
    values=_named(operand.values, role, kind),
    group_scale=_named(operand.group_scale, role, "scales"),
    row_scale=_named(operand.row_scale, role, "scales"),
  )


def remat_policy(
  *, weights: bool = True, outputs: bool = True, also: Optional[Callable] = None
) -> Callable:
  """A `jax.checkpoint` policy (also `nn.remat`'s and `nnx.remat`'s `policy=`) that keeps
  what jaxquant's quantized layers leave for their backward GEMMs, every kind of it.

  Args:
    weights: keep the weights' residuals too (their columnwise codes: one byte a
      parameter per layer for FP8). False recomputes the weight's cast (and, for an FSDP
      weight, its gather) in the backward pass instead.
    outputs: keep the layers' outputs (`jaxquant.output`), kept only where the backward of
      what reads them needs them (an activation function, attention): then no layer's
      forward GEMM and input cast runs again. False keeps the residuals alone, and a
      layer whose output the backward needs is recomputed, its input cast included.
    also: another policy (returning True / False) whose saves are kept as well, e.g.
      `jax.checkpoint_policies.save_only_these_names(...)` of the model's own names.
  """
  names = [residual_name("input", kind) for kind in RESIDUAL_KINDS]
  if weights:
    names += [residual_name("weight", kind) for kind in RESIDUAL_KINDS]
  if outputs:
    names.append(OUTPUT_NAME)
  policy = jax.checkpoint_policies.save_only_these_names(*names)
  if also is None:
    return policy
  if not callable(also):
    raise TypeError(
      f"remat_policy: also must be a jax.checkpoint policy (a callable), got {also!r}"
    )
  return jax.checkpoint_policies.save_from_both_policies(policy, also)
