"""A layer's contraction as one GEMM: plans, dim checks, and the call into `ops.dense`.

Flax's Dense, DenseGeneral and (two-operand) Einsum all contract some axes of the input
with some axes of the kernel. When no axis is shared by input, kernel and output (a
batched GEMM), the contraction is one GEMM: x viewed as [M, K], the kernel as [K, N],
y as [M, N], then reshaped and transposed into the layer's output. `GemmPlan` records
those permutations; `quantized_gemm` runs it through `jaxquant.ops.dense`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional

import jax
import jax.numpy as jnp

from jaxquant import ops
from jaxquant.ops.operands import FORWARD_USAGES, gemm_matrices
from jaxquant.quantizers import Quantizer, for_usage

# The logical matrix of each role and the GEMM dim each of its axes is.
_ROLE_DIMS = {"input": ("M (rows of the input)", "K (contraction)"),
              "weight": ("N (output features)", "K (contraction)"),
              "grad_output": ("M (rows of the input)", "N (output features)")}


@dataclasses.dataclass(frozen=True)
class GemmPlan:
  """y = transpose(reshape(x[x_perm] @ kernel[kernel_perm])) for one contraction."""

  x_perm: tuple[int, ...]  # x axes -> (free..., contracted...)
  kernel_perm: tuple[int, ...]  # kernel axes -> (contracted..., free...)
  n_contracted: int
  out_perm: tuple[int, ...]  # (x free..., kernel free...) -> the layer's output order

  def run(self, x: jax.Array, kernel: jax.Array, gemm) -> tuple[jax.Array, object]:
    """Reshapes to [M, K] x [K, N], calls gemm(x2d, k2d) -> (y2d, aux), reshapes back."""
    xt = jnp.transpose(x, self.x_perm)
    kt = jnp.transpose(kernel, self.kernel_perm)
    split = xt.ndim - self.n_contracted
    x_free, contracted = xt.shape[:split], xt.shape[split:]
    k_free = kt.shape[self.n_contracted:]
    y2d, aux = gemm(xt.reshape(math.prod(x_free), math.prod(contracted)),
                    kt.reshape(math.prod(contracted), math.prod(k_free)))
    return jnp.transpose(y2d.reshape(x_free + k_free), self.out_perm), aux


def _identity(n: int) -> tuple[int, ...]:
  return tuple(range(n))


def plan_dense_general(x_ndim: int, axis: tuple[int, ...], n_features: int) -> GemmPlan:
  """DenseGeneral without batch_dims: kernel [*contracted, *features]."""
  free = tuple(a for a in range(x_ndim) if a not in axis)
  return GemmPlan(free + tuple(axis), _identity(len(axis) + n_features), len(axis),
                  _identity(len(free) + n_features))


def plan_einsum(lhs: str, rhs: str, out: str, what: str) -> GemmPlan:
  """A two-operand einsum `lhs,rhs->out` (ellipses expanded) as one GEMM."""
  for operand, letters in (("input", lhs), ("kernel", rhs), ("output", out)):
    if len(set(letters)) != len(letters):
      raise ValueError(f"{what}: einsum '{lhs},{rhs}->{out}' repeats an axis of the {operand}; "
                       "a quantized einsum must be a GEMM (no diagonals)")
  batch = [c for c in lhs if c in rhs and c in out]
  if batch:
    raise ValueError(f"{what}: einsum '{lhs},{rhs}->{out}' has batch axes {batch} (in input, "
                     "kernel and output): that is a batched GEMM, which quantized layers do "
                     "not support; map this module to None (high precision) in the recipe")
  summed = [c for c in lhs if c not in rhs and c not in out] + \
           [c for c in rhs if c not in lhs and c not in out]
  if summed:
    raise ValueError(f"{what}: einsum '{lhs},{rhs}->{out}' sums axes {summed} of one operand "
                     "only; a quantized einsum must be a GEMM")
  contracted = [c for c in lhs if c in rhs]
  x_free = [c for c in lhs if c in out]
  k_free = [c for c in rhs if c in out]
  gemm_out = x_free + k_free
  return GemmPlan(tuple(lhs.index(c) for c in x_free + contracted),
                  tuple(rhs.index(c) for c in contracted + k_free), len(contracted),
                  tuple(gemm_out.index(c) for c in out))


def check_gemm_dims(m: int, k: int, n: int, quantizers: Mapping[str, Optional[Quantizer]],
                    what: str) -> None:
  """Raises, naming the role and the GEMM dim (M, K or N), if a quantizer's blocks do not
  tile a dim of the matrix the forward GEMM quantizes (`ops.dense` checks the backward's
  usages when a backward is traced, so that few-token inference is not refused)."""
  sizes = gemm_matrices(m, k, n)
  for tensor_type, quantizer in quantizers.items():
    rows, cols = sizes[tensor_type]
    row_dim, col_dim = _ROLE_DIMS[tensor_type]
    for usage in FORWARD_USAGES[tensor_type]:
      q = for_usage(quantizer, usage)
      if q is None:
        continue
      fmt = q.format(usage)
      if fmt.partial_blocks:
        continue
      # Stored layout: rowwise [rows, cols]; columnwise [cols, rows] (transposed).
      stored = ((rows, row_dim), (cols, col_dim))
      if usage == "columnwise":
        stored = stored[::-1]
      for (size, dim), block in zip(stored, fmt.block):
        if block > 1 and size % block:
          raise ValueError(
              f"{what}: the {tensor_type} quantizer {q!r} does not fit dim {dim} = {size}: "
              f"its {usage} usage needs it divisible by {block}; change the layer's shape or "
              f"map this role to another quantizer (or None) in the recipe")


def quantized_gemm(plan: GemmPlan, x: jax.Array, kernel: jax.Array, *,
                   quantizers: Mapping[str, Optional[Quantizer]], backward: str, name: str,
                   what: str, key: Optional[jax.Array], state: Optional[dict]):
  """The layer's output through `ops.dense`, and the new delayed-scaling state (or None)."""

  def gemm(x2d, k2d):
    check_gemm_dims(x2d.shape[0], x2d.shape[1], k2d.shape[1], quantizers, what)
    out = ops.dense(x2d, k2d, quantizers=dict(quantizers), backward=backward, name=name,
                    module_type="linear", key=key, state=state)
    return out if state is not None else (out, None)

  return plan.run(x, kernel, gemm)
