"""The grouped GEMM of `grouped_dense`: out[m] = sum_c a[m, c] * b[group(m), n, c], fp32.

Operands arrive as fp32 values (block scales applied, outer scales not) together with the
narrow dtype that holds each of them exactly: the FP8 element type for per-tensor FP8
codes, bfloat16 for values exact in bf16 (MXFP8, NVFP4, block FP8 with power-of-two
scales, bf16 inputs), None otherwise. Where the kernel runs (the backend choice,
ops/_backend.py), a pair that the CUTLASS grouped kernel runs exactly goes there:
FP8 x FP8 on FP8 tensor cores, anything exact in bf16 on bf16 ones; every other pair,
and every other platform, runs `reference._ragged.ragged_matmul`. Both form the same
products; the bf16 kernel sums them in fp32 in another order, the FP8 one with Hopper's
FP8 accumulation (about 1e-4 relative, docs/numerics.md). An empty problem (no rows, no
groups, K or N = 0) is zeros, with no kernel launched on it.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxquant.kernels import _grouped as kernel
from jaxquant.ops._backend import read_backend
from jaxquant.reference._grouped import GroupLayout
from jaxquant.reference._ragged import ragged_matmul

_FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def kernel_dtypes(a_exact, b_exact, k: int, n: int):
  """(A dtype, B dtype) the kernel takes this pair in, or None when it does not."""
  if a_exact is None or b_exact is None:
    return None
  pair = (jnp.dtype(a_exact), jnp.dtype(b_exact))
  if not (
    pair[0] in _FP8
    and pair[1] in _FP8
    and kernel.unsupported_reason(*pair, k, n, jnp.float32) is None
  ):
    pair = (jnp.dtype(jnp.bfloat16),) * 2  # FP8 values are exact in bf16 too
  return None if kernel.unsupported_reason(*pair, k, n, jnp.float32) else pair


def grouped_matmul(
  a: jax.Array,
  b: jax.Array,
  layout: GroupLayout,
  *,
  a_exact: Optional[jnp.dtype] = None,
  b_exact: Optional[jnp.dtype] = None,
  tile: int = 0,
  implementation: Optional[str] = None,
) -> jax.Array:
  """fp32 [rows, N] from a [rows, K] and b [G, N, K] (rows of no group are zero)."""
  if 0 in (*a.shape, *b.shape):  # no output, no group, or empty sums: zeros, no kernel
    return jnp.zeros((a.shape[0], b.shape[1]), jnp.float32)
  runs = read_backend(implementation).runs("grouped_gemm")
  pair = kernel_dtypes(a_exact, b_exact, a.shape[1], b.shape[1])
  if not runs or pair is None:
    return ragged_matmul(a, b, layout, tile=tile)
  ones = jnp.ones((layout.num_groups,), jnp.float32)
  return kernel.grouped_gemm(
    a.astype(pair[0]), b.astype(pair[1]), layout.sizes, ones, out_dtype=jnp.float32
  )
