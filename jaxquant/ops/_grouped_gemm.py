"""The grouped GEMMs of `grouped_dense`, on `GroupedOperand`s (ops/_grouped_operands.py).

- `grouped_matmul` (fprop, dgrad): out[m] = sum_c a[m, c] * b[group(m), n, c], times the
  groups' and rows' scales: [rows, N].
- `grouped_contract` (wgrad): out[g] = sum over the rows m of group g of a[m, p] * b[m, q],
  times the groups' scales: [G, P, Q].

Where the kernels run (the backend choice, ops/_backend.py) and both operands are held
exactly by a pair the CUTLASS grouped kernel takes (FP8 x FP8 on FP8 tensor cores, anything
exact in bf16 on bf16 ones), the products run there: `kernels.grouped_gemm` for the first,
`kernels.grouped_wgrad` on the columnwise operands moved to its aligned column layout for
the second, each group's scales folded into the kernel's alpha. Every other pair, and every
other platform, runs `reference._ragged`'s scanned fp32 products. Both form the same
products; the bf16 kernel sums them in fp32 in another order, the FP8 one with Hopper's FP8
accumulation (about 1e-4 relative, docs/numerics.md), and alpha is the product of the two
scales (one rounding where the reference multiplies twice). An empty problem is zeros,
with no kernel launched on it.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxquant.kernels import _grouped as kernel
from jaxquant.ops._backend import read_backend
from jaxquant.ops._grouped_operands import GroupedOperand
from jaxquant.reference._grouped import GroupLayout
from jaxquant.reference._ragged import ragged_contract, ragged_matmul

_FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_BF16 = jnp.dtype(jnp.bfloat16)


def kernel_dtypes(
  a_exact, b_exact, k: int, n: int, out_dtype=jnp.float32, *, columns_aligned: bool = False
):
  """(A dtype, B dtype) the kernel takes this pair in, or None when it does not."""
  if a_exact is None or b_exact is None:
    return None
  pair = (jnp.dtype(a_exact), jnp.dtype(b_exact))
  reason = lambda p: kernel.unsupported_reason(*p, k, n, out_dtype, columns_aligned=columns_aligned)
  if not (pair[0] in _FP8 and pair[1] in _FP8 and reason(pair) is None):
    pair = (_BF16, _BF16)  # FP8 values are exact in bf16 too
  return None if reason(pair) else pair


def _alpha(num_groups: int, *scales) -> jax.Array:
  """The product of the per-group scales given (ones where none is)."""
  alpha = jnp.ones((num_groups,), jnp.float32)
  for s in scales:
    if s is not None:
      alpha = alpha * s
  return alpha


def _kernel_out_dtype(out_dtype) -> jnp.dtype:
  out = jnp.dtype(out_dtype)
  return out if out in (jnp.dtype(jnp.float32), _BF16) else jnp.dtype(jnp.float32)


def grouped_matmul(
  a: GroupedOperand,
  b: GroupedOperand,
  *,
  out_dtype=jnp.float32,
  tile: int = 0,
  implementation: Optional[str] = None,
) -> jax.Array:
  """[rows, N] in out_dtype from a [rows, K] (with its layout) and b [G, N, K]; rows of no
  group are zero."""
  layout = a.layout
  rows, n = a.values.shape[0], b.values.shape[1]
  if 0 in (*a.values.shape, *b.values.shape):  # no output, no group, or empty sums: zeros
    return jnp.zeros((rows, n), out_dtype)
  alpha = _alpha(layout.num_groups, a.group_scale, b.group_scale)
  runs = read_backend(implementation).runs("grouped_gemm")
  # With no row scale after it, the kernel writes the result itself (rows of no group as
  # zeros); with one, it writes fp32 products for the scale.
  kernel_out = _kernel_out_dtype(out_dtype) if a.row_scale is None else jnp.dtype(jnp.float32)
  pair = kernel_dtypes(a.exact, b.exact, a.values.shape[1], n, kernel_out)
  on_kernel = runs and pair is not None
  if on_kernel:
    y = kernel.grouped_gemm(
      a.values.astype(pair[0]), b.values.astype(pair[1]), layout.sizes, alpha, out_dtype=kernel_out
    )
  else:
    y = ragged_matmul(a.values.astype(jnp.float32), b.values.astype(jnp.float32), layout, tile=tile)
    y = y * alpha[layout.row_gather_ids()][:, None]
  if a.row_scale is not None:
    y = y * a.row_scale[:, None]
  if not (on_kernel and a.row_scale is None):
    y = jnp.where(layout.row_mask()[:, None], y, 0.0)
  return y.astype(out_dtype)


def _aligned_sources(layout: GroupLayout, columns: int) -> jax.Array:
  """The row of a [rows, C] operand that each of the wgrad kernel's `columns` reads: group
  g's rows from kernel.column_starts(sizes)[g] (the gap columns take rows never read)."""
  aligned = kernel.aligned_layout(layout.sizes, columns)
  group = aligned.row_gather_ids()
  local = jnp.arange(columns, dtype=jnp.int32) - aligned.starts[group]
  return jnp.clip(layout.starts[group] + local, 0, layout.rows - 1)


def grouped_contract(
  a: GroupedOperand,
  b: GroupedOperand,
  *,
  out_dtype=jnp.float32,
  tile: int = 0,
  implementation: Optional[str] = None,
) -> jax.Array:
  """[G, P, Q] in out_dtype: each group's a [rows, P]^T . b [rows, Q] over its rows, times
  both operands' group scales. a and b share their row layout (which may be padded)."""
  layout = a.layout
  (rows, p), q = a.values.shape, b.values.shape[1]
  num_groups = layout.num_groups
  if 0 in (rows, p, q, num_groups):
    return jnp.zeros((num_groups, p, q), out_dtype)
  alpha = _alpha(num_groups, a.group_scale, b.group_scale)
  runs = read_backend(implementation).runs("grouped_gemm")
  columns = kernel.aligned_columns(rows, num_groups)
  kernel_out = _kernel_out_dtype(out_dtype)
  pair = kernel_dtypes(a.exact, b.exact, columns, q, kernel_out, columns_aligned=True)
  if runs and pair is not None:
    # Both operands' columns from one gather of their shared rows, transposed.
    sources = _aligned_sources(layout, columns)
    a_t, b_t = (
      jnp.take(op.values.astype(t), sources, axis=0).T for op, t in zip((a, b), pair, strict=True)
    )
    out = kernel.grouped_wgrad(a_t, b_t, layout.sizes, alpha, out_dtype=kernel_out)
    return out.astype(out_dtype)
  f32 = lambda op: op.values.astype(jnp.float32)
  out = ragged_contract(f32(a), f32(b), layout, tile=tile)
  return (out * alpha[:, None, None]).astype(out_dtype)
