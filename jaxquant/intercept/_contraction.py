"""A layer's contraction as one GEMM: plans, dim checks, and the call into `ops.dense`.

Flax's Dense, DenseGeneral and (two-operand) Einsum all contract some axes of the input
with some axes of the kernel. When no axis is shared by input, kernel and output (a
batched GEMM), the contraction is one GEMM: x viewed as [M, K], the kernel as [K, N],
y as [M, N], then reshaped and transposed into the layer's output. `GemmPlan` records
those permutations; `quantized_gemm` runs it through `jaxquant.ops.dense`.

Axes shared by input, kernel and output (per-expert weights `EDF` with tokens `E...D`)
are batch axes: one GEMM per batch index, all of the same size, which `GroupedPlan`
runs through `jaxquant.ops.grouped_dense` (equal group sizes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping, Optional

import jax
import jax.numpy as jnp

from jaxquant import ops, recipes
from jaxquant.intercept import _session as sessions
from jaxquant.ops._operands import FORWARD_USAGES, gemm_matrices, usages_to_quantize
from jaxquant.quantizers import Quantizer, for_usage
from jaxquant.roles import LINEAR

# The logical matrix of each role and the GEMM dim each of its axes is.
_ROLE_DIMS = {
  "input": ("M (rows of the input)", "K (contraction)"),
  "weight": ("N (output features)", "K (contraction)"),
  "grad_output": ("M (rows of the input)", "N (output features)"),
}


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
    k_free = kt.shape[self.n_contracted :]
    y2d, aux = gemm(
      xt.reshape(math.prod(x_free), math.prod(contracted)),
      kt.reshape(math.prod(contracted), math.prod(k_free)),
    )
    return jnp.transpose(y2d.reshape(x_free + k_free), self.out_perm), aux

  def dims(self, x_shape, kernel_shape) -> tuple[int, int, int]:
    """(M, K, N) of the GEMM for operands of these shapes."""
    x_free = [x_shape[a] for a in self.x_perm[: len(self.x_perm) - self.n_contracted]]
    contracted = [x_shape[a] for a in self.x_perm[len(self.x_perm) - self.n_contracted :]]
    k_free = [kernel_shape[a] for a in self.kernel_perm[self.n_contracted :]]
    return math.prod(x_free), math.prod(contracted), math.prod(k_free)


@dataclasses.dataclass(frozen=True)
class GroupedPlan:
  """A batched contraction as one grouped GEMM: batch index g multiplies its rows of x by
  kernel[g]. y = transpose(reshape(grouped(x[x_perm], kernel[kernel_perm])))."""

  x_perm: tuple[int, ...]  # x axes -> (batch..., free..., contracted...)
  kernel_perm: tuple[int, ...]  # kernel axes -> (batch..., contracted..., free...)
  n_batch: int
  n_contracted: int
  out_perm: tuple[int, ...]  # (batch..., x free..., kernel free...) -> the output order

  def _split(self, x_shape, kernel_shape):
    xs = [x_shape[a] for a in self.x_perm]
    ks = [kernel_shape[a] for a in self.kernel_perm]
    split = len(xs) - self.n_contracted
    batch, x_free = xs[: self.n_batch], xs[self.n_batch : split]
    contracted, k_free = xs[split:], ks[self.n_batch + self.n_contracted :]
    return batch, x_free, contracted, k_free

  def dims(self, x_shape, kernel_shape) -> tuple[int, int, int]:
    """(M, K, N) of one group's GEMM."""
    _, x_free, contracted, k_free = self._split(x_shape, kernel_shape)
    return math.prod(x_free), math.prod(contracted), math.prod(k_free)

  def run(self, x: jax.Array, kernel: jax.Array, grouped_gemm) -> tuple[jax.Array, object]:
    """Calls grouped_gemm(x2d [G*M, K], kernel [G, K, N], group_sizes [G]) -> (y2d, aux)."""
    batch, x_free, contracted, k_free = self._split(x.shape, kernel.shape)
    groups, rows = math.prod(batch), math.prod(x_free)
    k, n = math.prod(contracted), math.prod(k_free)
    x2d = jnp.transpose(x, self.x_perm).reshape(groups * rows, k)
    k3d = jnp.transpose(kernel, self.kernel_perm).reshape(groups, k, n)
    y2d, aux = grouped_gemm(x2d, k3d, jnp.full((groups,), rows, jnp.int32))
    y = y2d.reshape(tuple(batch) + tuple(x_free) + tuple(k_free))
    return jnp.transpose(y, self.out_perm), aux


def _identity(n: int) -> tuple[int, ...]:
  return tuple(range(n))


def plan_dense_general(x_ndim: int, axis: tuple[int, ...], n_features: int) -> GemmPlan:
  """DenseGeneral without batch_dims: kernel [*contracted, *features]."""
  free = tuple(a for a in range(x_ndim) if a not in axis)
  return GemmPlan(
    free + tuple(axis),
    _identity(len(axis) + n_features),
    len(axis),
    _identity(len(free) + n_features),
  )


def not_a_gemm(lhs: str, rhs: str, out: str) -> Optional[str]:
  """Why the contraction `lhs,rhs->out` (input, kernel) is no (batched) GEMM, or None."""
  for operand, letters in (("input", lhs), ("kernel", rhs), ("output", out)):
    if len(set(letters)) != len(letters):
      return f"it repeats an axis of the {operand} (a diagonal)"
  summed = [c for c in lhs if c not in rhs and c not in out] + [
    c for c in rhs if c not in lhs and c not in out
  ]
  if summed:
    return f"it sums axes {summed} of one operand only"
  if [c for c in out if c not in lhs + rhs]:
    return "its output has an axis of neither operand"
  return None


def contracts_no_axis(lhs: str, rhs: str, out: str) -> bool:
  """Whether `lhs,rhs->out` sums over no shared axis (K = 1): a product of every pair of
  elements (a norm's scale, `...k,k->...k`; an outer product), not a dot product of rows
  and columns, so no GEMM, whatever its operands are."""
  return not [c for c in lhs if c in rhs and c not in out]


def plan_einsum(lhs: str, rhs: str, out: str, what: str) -> GemmPlan:
  """A two-operand einsum `lhs,rhs->out` (ellipses expanded) as one GEMM."""
  reason = not_a_gemm(lhs, rhs, out)
  if reason:
    raise ValueError(
      f"{what}: einsum '{lhs},{rhs}->{out}': {reason}; a quantized einsum must be a GEMM"
    )
  batch = [c for c in lhs if c in rhs and c in out]
  if batch:
    raise ValueError(
      f"{what}: einsum '{lhs},{rhs}->{out}' has batch axes {batch} (in input, "
      "kernel and output): that is a batched GEMM, which quantized layers do "
      "not support; map this module to None (high precision) in the recipe"
    )
  return plan_contraction(lhs, rhs, out)


def plan_contraction(lhs: str, rhs: str, out: str):
  """Input `lhs` and kernel `rhs` contracted into `out` (a GEMM: `not_a_gemm` is None):
  a GemmPlan, or a GroupedPlan when axes are shared by input, kernel and output."""
  batch = [c for c in lhs if c in rhs and c in out]
  contracted = [c for c in lhs if c in rhs and c not in out]
  x_free = [c for c in lhs if c in out and c not in rhs]
  k_free = [c for c in rhs if c in out and c not in lhs]
  gemm_out = batch + x_free + k_free
  out_perm = tuple(gemm_out.index(c) for c in out)
  x_perm = tuple(lhs.index(c) for c in batch + x_free + contracted)
  kernel_perm = tuple(rhs.index(c) for c in batch + contracted + k_free)
  if batch:
    return GroupedPlan(x_perm, kernel_perm, len(batch), len(contracted), out_perm)
  return GemmPlan(x_perm, kernel_perm, len(contracted), out_perm)


def _blocked_dims(m, k, n, quantizers, backward):
  """(tensor type, quantizer, usage, format, size, dim, block) of each dim of a matrix the
  GEMMs quantize in blocks that must tile it: the forward's usages, and the backward's
  too when `backward` (a recipes.BackwardMode) is given. Formats whose edge blocks may be
  partial tile every size and are left out."""
  sizes = gemm_matrices(m, k, n)
  for tensor_type, quantizer in quantizers.items():
    rows, cols = sizes[tensor_type]
    row_dim, col_dim = _ROLE_DIMS[tensor_type]
    usages = (
      FORWARD_USAGES[tensor_type]
      if backward is None
      else tuple(set(FORWARD_USAGES[tensor_type]) | set(usages_to_quantize(tensor_type, backward)))
    )
    for usage in sorted(usages, reverse=True):  # rowwise first
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
      for (size, dim), block in zip(stored, fmt.block, strict=False):
        if block > 1:
          yield tensor_type, q, usage, fmt, size, dim, block


def unfit_reason(
  m: int,
  k: int,
  n: int,
  quantizers: Mapping[str, Optional[Quantizer]],
  *,
  backward: Optional[str] = None,
) -> Optional[str]:
  """Why a quantizer's blocks do not tile a dim of a matrix its GEMMs quantize (naming the
  role and the GEMM dim M, K or N), or None. The forward's usages only, unless `backward`
  (a recipes.BackwardMode) asks for those of the backward GEMMs too. M = 0 skips M (a
  grouped GEMM pads each group to its blocks)."""
  for tensor_type, q, usage, _, size, dim, block in _blocked_dims(m, k, n, quantizers, backward):
    if size % block:
      return (
        f"the {tensor_type} quantizer {q!r} does not fit dim {dim} = {size}: its "
        f"{usage} usage needs it divisible by {block}"
      )
  return None


def tiny_reason(
  k: int, n: int, quantizers: Mapping[str, Optional[Quantizer]], backward: str
) -> Optional[str]:
  """Why a weight GEMM is tiny, e.g. "N=4 is smaller than one block (32) of mxfp8", or
  None: its N, else its K, is smaller than the largest block that a quantizer applies
  along it in a usage its GEMMs (forward and backward, per `backward`) consume. M (the
  rows of a call) never counts. A tiny GEMM never fits (`unfit_reason`)."""
  blocked = list(_blocked_dims(0, k, n, quantizers, backward))
  for letter, size in (("N", n), ("K", k)):
    blocks = [(b, fmt) for _, _, _, fmt, s, dim, b in blocked if dim.startswith(letter) and s]
    if blocks and size < max(b for b, _ in blocks):
      block, fmt = max(blocks, key=lambda bf: bf[0])
      return f"{letter}={size} is smaller than one block ({block}) of {fmt.family.value}"
  return None


def tiny_status(k: int, n: int, quantizers, recipe: recipes.CustomRecipe) -> Optional[str]:
  """The status row of a tiny weight GEMM that `recipe` keeps in high precision
  (`CustomRecipe.tiny_gemms_in_high_precision`), or None: the GEMM follows the recipe."""
  if not recipe.tiny_gemms_in_high_precision:
    return None
  reason = tiny_reason(k, n, quantizers, recipe.backward)
  return None if reason is None else sessions.high_precision_status(reason)


def unfit_error(what: str, reason: str, role: str) -> ValueError:
  """The error of a GEMM whose shape its quantizers do not fit, naming the role and the
  ways out, `on_unfit='high_precision'` among them."""
  return ValueError(
    f"{what}: {reason}; change the shape or map role {role!r} to another quantizer (or "
    "None) in the recipe, or pass on_unfit='high_precision' to quantize_model"
  )


def check_gemm_dims(
  m: int,
  k: int,
  n: int,
  quantizers: Mapping[str, Optional[Quantizer]],
  what: str,
  role: str,
  *,
  backward: Optional[str] = None,
) -> None:
  """Raises `unfit_error` if a quantizer's blocks do not tile a dim of a matrix the
  forward GEMM quantizes, or, given `backward`, K or N (the weight's dims) of one a
  backward GEMM quantizes: such a weight can never train, and the error comes at its first
  call rather than from the gradient's trace (under `jax.checkpoint`, far from this
  layer). M of the backward is checked when a backward is traced (`quantized_gemm`), so
  that few-token inference is not refused."""
  reason = unfit_reason(m, k, n, quantizers)
  if reason is None and backward is not None:
    reason = unfit_reason(0, k, n, quantizers, backward=backward)
  if reason:
    raise unfit_error(what, reason, role)


def quantized_gemm(
  plan: GemmPlan,
  x: jax.Array,
  kernel: jax.Array,
  *,
  quantizers: Mapping[str, Optional[Quantizer]],
  backward: str,
  name: str,
  what: str,
  key: Optional[jax.Array],
  state: Optional[dict],
  layer_input: jax.Array,
  weight_gather: Optional[ops.WeightGather] = None,
  fast_accumulation: frozenset = frozenset(),
  shard_scaling: Optional[ops.ShardScaling] = None,
):
  """The layer's output through `ops.dense`, and the new delayed-scaling state (or None).
  `weight_gather` describes the GEMM's 2-D [K, N] kernel; `fast_accumulation` names the
  GEMMs allowed FP8 fast accumulation, `shard_scaling` the mesh axes over whose row shards
  the input and output gradient are scaled (ops.dense). Under a swap-in session, a
  delayed-scaling input is quantized with the state of the session's first GEMM whose
  layer was called with the same `layer_input` (x before the layer promoted its dtype),
  promoted alike (`Session.input_state`)."""
  session = sessions.current()
  if state is not None and "input" in state and session is not None:
    shared = session.input_state(layer_input, x.dtype, quantizers["input"], state["input"])
    state = dict(state, input=shared)

  def gemm(x2d, k2d):
    m, k, n = x2d.shape[0], x2d.shape[1], k2d.shape[1]
    check_gemm_dims(m, k, n, quantizers, what, name, backward=backward)
    dense = functools.partial(
      ops.dense,
      x2d,
      k2d,
      quantizers=dict(quantizers),
      backward=backward,
      name=name,
      module_type=LINEAR,
      key=key,
      state=state,
      weight_gather=weight_gather,
      fast_accumulation=fast_accumulation,
      shard_scaling=shard_scaling,
    )
    backward_reason = unfit_reason(m, k, n, quantizers, backward=backward)
    if backward_reason is None:
      out = dense()
    else:
      # The rows M of this call do not tile a backward usage: ops.dense refuses them when
      # a gradient is traced (its forward rule runs inside this call, unless a
      # `jax.checkpoint` defers it); the error says which role and what to do.
      try:
        out = dense()
      except ValueError as error:
        raise unfit_error(
          what, f"{backward_reason}, for a backward GEMM ({error})", name
        ) from error
    return out if state is not None else (out, None)

  return plan.run(x, kernel, gemm)
