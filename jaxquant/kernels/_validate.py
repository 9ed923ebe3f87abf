"""Input checks made in Python, at trace time, before anything reaches a kernel.

A kernel re-checks only what would make it touch memory out of bounds; every rule a
caller can break is rejected here with a message naming the value and the rule.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxquant.formats import INPUT_DTYPES


def check_matrix(x, what: str, *, rows_multiple: int = 1, cols_multiple: int = 1) -> None:
  if jnp.ndim(x) != 2:
    raise ValueError(f"{what}: expects a [M, K] matrix, got shape {tuple(jnp.shape(x))}")
  if jnp.dtype(x.dtype) not in INPUT_DTYPES:
    raise TypeError(f"{what}: input dtype must be bfloat16, float16 or float32, got {x.dtype}")
  rows, cols = x.shape
  if rows % rows_multiple:
    raise ValueError(f"{what}: M = {rows} must be a multiple of {rows_multiple}")
  if cols % cols_multiple:
    raise ValueError(f"{what}: K = {cols} must be a multiple of {cols_multiple}")


def check_array(a, what: str, shape: tuple, dtype) -> None:
  if tuple(jnp.shape(a)) != tuple(shape) or jnp.dtype(a.dtype) != jnp.dtype(dtype):
    raise ValueError(
      f"{what}: expected {jnp.dtype(dtype).name}{list(shape)}, got "
      f"{jnp.dtype(a.dtype).name}{list(jnp.shape(a))}"
    )


# Output dtypes of the GEMM kernels (block FP8, per-tensor FP8).
GEMM_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def gemm_shape_reason(n: int, k: int, out_dtype) -> str | None:
  """The rules the FP8 GEMM kernels share, or None: bf16 / fp32 output, K a multiple of
  16 and 16-byte aligned output rows (TMA and cuBLASLt alike)."""
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype not in GEMM_OUT_DTYPES:
    return f"the output dtype must be bfloat16 or float32, got {out_dtype.name}"
  if k % 16:
    return f"K = {k} must be a multiple of 16"
  if (n * out_dtype.itemsize) % 16:
    return f"N = {n} must be a multiple of {16 // out_dtype.itemsize} for a {out_dtype.name} output"
  return None


def check_gemm_operands(a, b, what: str) -> tuple[int, int, int]:
  """(M, N, K) of A [M, K] and B [N, K], or a ValueError naming the shapes."""
  if jnp.ndim(a) != 2 or jnp.ndim(b) != 2:
    raise ValueError(
      f"{what}: expects A [M, K] and B [N, K], got shapes "
      f"{tuple(jnp.shape(a))} and {tuple(jnp.shape(b))}"
    )
  (m, k), (n, kb) = a.shape, b.shape
  if kb != k:
    raise ValueError(f"{what}: contraction dims differ: A has K={k}, B has K={kb}")
  return m, n, k
