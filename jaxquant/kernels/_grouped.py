"""Grouped GEMM kernels, group sizes on the device, in two groupings:

- `grouped_gemm` (fprop, dgrad): D[rows of g] = alpha[g] * A[rows of g] . B[g]^T, A [M, K],
  B [G, N, K] ("TN", like `ops.gemm`), D [M, N]. Group g owns the group_sizes[g] rows
  after those of the groups before it (sizes clipped at M, as
  `reference.grouped.group_layout`); rows of no group are zero.
- `grouped_wgrad` (wgrad, the "K-grouped" problem list): D[g] = alpha[g] * A[:, cols of g]
  . B[:, cols of g]^T, A [P, L], B [Q, L], D [G, P, Q]. Group g owns group_sizes[g] columns
  from `column_starts` (each group from a multiple of COLUMN_ALIGN, the 16-byte boundary
  TMA reads from); columns between a group's end and the next start are never read; an
  empty group's D[g] is zero. A and B are the columnwise (transposed) operands of wgrad,
  laid out by `ops`' grouped casts.

group_sizes int32 [G], alpha fp32 [G]; D in bfloat16 or float32. On CUDA both are the
CUTLASS Hopper pointer-array kernel (ffi/gemm/grouped_gemm.cuh); elsewhere
`reference._ragged`'s products, which define the numbers. The kernel matches them up to
fp32 summation order for bf16 operands, and within Hopper's FP8 accumulation (about 1e-4
relative, normwise) for FP8 pairs: docs/numerics.md.

Operand pairs: bfloat16 x bfloat16, and FP8 E4M3 x E4M3, E4M3 x E5M2, E5M2 x E4M3.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.core import ShapedArray

from jaxquant.kernels import _primitive as primitive
from jaxquant.kernels import _sharding as sharding
from jaxquant.kernels import _validate as validate
from jaxquant.reference._grouped import GroupLayout, group_layout, to_layout
from jaxquant.reference._ragged import ragged_contract, ragged_matmul

_FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_BF16 = jnp.dtype(jnp.bfloat16)
OUT_DTYPES = validate.GEMM_OUT_DTYPES


@dataclasses.dataclass(frozen=True)
class GroupedGemmConfig:
  """Both groupings' config: the output dtype, all their handlers take."""

  out_dtype: str

  def ffi_attributes(self) -> dict:
    return {}  # the result buffer's dtype says the output type on the C++ side


def _abstract_eval(a, b, group_sizes, alpha, *, config):
  return [ShapedArray((a.shape[0], b.shape[1]), jnp.dtype(config.out_dtype))]


def _reference(a, b, group_sizes, alpha, *, config):
  layout = group_layout(group_sizes, a.shape[0])
  acc = ragged_matmul(a.astype(jnp.float32), b.astype(jnp.float32), layout)
  alpha_rows = jnp.where(layout.row_mask(), alpha[layout.row_gather_ids()], 0.0)
  return [(acc * alpha_rows[:, None]).astype(config.out_dtype)]


# Kept whole: a row shard would need each group's rows re-counted per shard; under a
# sharded jit the operands are gathered first (docs/kernels.md).
_partition, _sharding_rule = sharding.kept_whole(4)


def _workspace_dims(config, a, b, group_sizes, alpha):
  return (b.shape[0],)


SPEC = primitive.KernelSpec(
  name="jaxquant_grouped_gemm",
  abstract_eval=_abstract_eval,
  reference=_reference,
  partition=_partition,
  sharding_rule=_sharding_rule,
  workspace_dims=_workspace_dims,
)
grouped_gemm_p = primitive.define(SPEC)


# ---- The contraction grouping (wgrad) ----

COLUMN_ALIGN = 16  # ffi/gemm/grouped_gemm.cuh's kColumnAlign


def column_starts(group_sizes: jax.Array) -> jax.Array:
  """Each group's first column in the wgrad grouping: the sizes before it, each rounded up
  to COLUMN_ALIGN (int32 [G])."""
  spans = -(-jnp.maximum(group_sizes, 0) // COLUMN_ALIGN) * COLUMN_ALIGN
  return (jnp.cumsum(spans) - spans).astype(jnp.int32)


def aligned_columns(rows: int, num_groups: int) -> int:
  """Static bound on the columns of the wgrad grouping for `rows` rows in `num_groups`
  groups: every group may add COLUMN_ALIGN - 1 columns of padding."""
  total = rows + num_groups * (COLUMN_ALIGN - 1)
  return -(-total // COLUMN_ALIGN) * COLUMN_ALIGN


def aligned_layout(group_sizes: jax.Array, columns: int) -> GroupLayout:
  """The wgrad grouping's columns as a row layout (`reference.grouped.GroupLayout`): group g
  on [column_starts[g], + group_sizes[g]), clipped at `columns`; the gaps belong to no group."""
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  starts = jnp.minimum(column_starts(sizes), columns)
  sizes = jnp.minimum(starts + sizes, columns) - starts
  index = jnp.arange(columns, dtype=jnp.int32)
  owner = jnp.searchsorted(starts, index, side="right", method="compare_all").astype(jnp.int32) - 1
  owner = jnp.maximum(owner, 0)
  inside = index < starts[owner] + sizes[owner]
  ids = jnp.where(inside, owner, len(group_sizes)).astype(jnp.int32)
  return GroupLayout(ids, starts, sizes)


def _wgrad_abstract_eval(a, b, group_sizes, alpha, *, config):
  return [ShapedArray((alpha.shape[0], a.shape[0], b.shape[0]), jnp.dtype(config.out_dtype))]


def _wgrad_reference(a, b, group_sizes, alpha, *, config):
  # The groups' columns moved back to back (a gather), then the reference's contraction.
  columns = a.shape[1]
  aligned = aligned_layout(group_sizes, columns)
  packed = group_layout(aligned.sizes, columns)
  rows = lambda m: to_layout(m.T.astype(jnp.float32), aligned, packed)
  acc = ragged_contract(rows(a), rows(b), packed)
  return [(acc * alpha[:, None, None]).astype(config.out_dtype)]


WGRAD_SPEC = primitive.KernelSpec(
  name="jaxquant_grouped_wgrad",
  abstract_eval=_wgrad_abstract_eval,
  reference=_wgrad_reference,
  partition=_partition,
  sharding_rule=_sharding_rule,
  workspace_dims=lambda config, a, b, group_sizes, alpha: (alpha.shape[0],),
)
grouped_wgrad_p = primitive.define(WGRAD_SPEC)


def grouped_wgrad(
  a: jax.Array, b: jax.Array, group_sizes: jax.Array, alpha: jax.Array, out_dtype=jnp.float32
) -> jax.Array:
  """D[g] = alpha[g] * A[:, cols of g] . B[:, cols of g]^T; A [P, L], B [Q, L] -> [G, P, Q]."""
  _, q, columns = validate.check_gemm_operands(a, b, "grouped_wgrad")  # L is their K
  g = jnp.shape(alpha)[0] if jnp.ndim(alpha) == 1 else -1
  _check_group_args(group_sizes, alpha, g, "grouped_wgrad")
  reason = unsupported_reason(a.dtype, b.dtype, columns, q, out_dtype, columns_aligned=True)
  if reason:
    raise ValueError(f"grouped_wgrad: {reason}")
  config = GroupedGemmConfig(out_dtype=jnp.dtype(out_dtype).name)
  return grouped_wgrad_p.bind(a, b, group_sizes, alpha, config=config)[0]


def _check_group_args(group_sizes, alpha, g, what):
  for name, arr, dtype in (("group_sizes", group_sizes, jnp.int32), ("alpha", alpha, jnp.float32)):
    if tuple(jnp.shape(arr)) != (g,) or jnp.dtype(arr.dtype) != jnp.dtype(dtype):
      raise ValueError(
        f"{what}: {name} must be {jnp.dtype(dtype).name}[{g}], got "
        f"{jnp.dtype(arr.dtype).name}{list(jnp.shape(arr))}"
      )


def unsupported_reason(
  a_dtype, b_dtype, k: int, n: int, out_dtype, *, columns_aligned: bool = False
) -> str | None:
  """Why the kernel cannot run this problem, or None. Every rule is one the kernel relies
  on: TMA needs each group's rows (K contiguous elements; in the wgrad grouping, the L
  columns, a multiple of COLUMN_ALIGN) to start on a 16-byte boundary, and D's rows (N)
  likewise."""
  a_dtype, b_dtype, out_dtype = map(jnp.dtype, (a_dtype, b_dtype, out_dtype))
  if columns_aligned and k % COLUMN_ALIGN:
    return f"L = {k} must be a multiple of {COLUMN_ALIGN}"
  fp8_pair = a_dtype in _FP8 and b_dtype in _FP8 and not (a_dtype == b_dtype == _FP8[1])
  if not (fp8_pair or a_dtype == b_dtype == _BF16):
    return (
      f"operands must be bfloat16 x bfloat16 or an FP8 pair other than E5M2 x E5M2, got "
      f"{a_dtype.name} x {b_dtype.name}"
    )
  if out_dtype not in OUT_DTYPES:
    return f"the output dtype must be bfloat16 or float32, got {out_dtype.name}"
  if (k * a_dtype.itemsize) % 16:
    return f"K = {k} must be a multiple of {16 // a_dtype.itemsize} for {a_dtype.name} operands"
  if (n * out_dtype.itemsize) % 16:
    return f"N = {n} must be a multiple of {16 // out_dtype.itemsize} for a {out_dtype.name} output"
  return None


def grouped_gemm(
  a: jax.Array, b: jax.Array, group_sizes: jax.Array, alpha: jax.Array, out_dtype=jnp.float32
) -> jax.Array:
  """D[rows of g] = alpha[g] * A[rows of g] . B[g]^T; rows of no group are zero."""
  if jnp.ndim(a) != 2 or jnp.ndim(b) != 3:
    raise ValueError(
      f"grouped_gemm: expects A [M, K] and B [G, N, K], got shapes "
      f"{tuple(jnp.shape(a))} and {tuple(jnp.shape(b))}"
    )
  (_, k), (g, n, kb) = a.shape, b.shape
  if kb != k:
    raise ValueError(f"grouped_gemm: contraction dims differ: A has K={k}, B has K={kb}")
  _check_group_args(group_sizes, alpha, g, "grouped_gemm")
  reason = unsupported_reason(a.dtype, b.dtype, k, n, out_dtype)
  if reason:
    raise ValueError(f"grouped_gemm: {reason}")
  config = GroupedGemmConfig(out_dtype=jnp.dtype(out_dtype).name)
  return grouped_gemm_p.bind(a, b, group_sizes, alpha, config=config)[0]
