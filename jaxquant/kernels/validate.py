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
    raise ValueError(f"{what}: expected {jnp.dtype(dtype).name}{list(shape)}, got "
                     f"{jnp.dtype(a.dtype).name}{list(jnp.shape(a))}")
