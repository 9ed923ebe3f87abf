"""A Flax GEMM layer's operands as the 2-D matrices its quantized GEMM multiplies.

The swap-in runs a Dense / DenseGeneral / Einsum (Linen) or Linear / Einsum (NNX) as one
GEMM, x viewed as [M, K] times the kernel viewed as [K, N] (`jaxquant.intercept._contraction`).
The sensitivity analysis measures quantization error on exactly those matrices, so it
takes the same view: `gemm_view(module, x, call_kwargs)` returns the layer's plan, or
None for a layer that is no such GEMM (a batched DenseGeneral, say).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import opt_einsum
from flax import nnx

from jaxquant.intercept import _contraction as contraction


@dataclasses.dataclass(frozen=True)
class GemmView:
  """How one call's x, kernel and output map to the GEMM's [M, K], [K, N] and [M, N]."""

  plan: contraction.GemmPlan

  def x_matrix(self, x: jax.Array) -> jax.Array:
    xt = jnp.transpose(x, self.plan.x_perm)
    split = xt.ndim - self.plan.n_contracted
    return xt.reshape(math.prod(xt.shape[:split]), math.prod(xt.shape[split:]))

  def kernel_matrix(self, kernel: jax.Array) -> jax.Array:
    kt = jnp.transpose(kernel, self.plan.kernel_perm)
    n = self.plan.n_contracted
    return kt.reshape(math.prod(kt.shape[:n]), math.prod(kt.shape[n:]))

  def output_matrix(self, y: jax.Array, n_rows: int) -> jax.Array:
    """The layer's output (or its gradient) back in the GEMM's [M, N] layout."""
    inverse = tuple(int(i) for i in np.argsort(self.plan.out_perm))
    yt = jnp.transpose(y, inverse)
    return yt.reshape(n_rows, -1)


def _einsum_view(einsum_str: str, x, kernel) -> Optional[GemmView]:
  equation = einsum_str.replace(" ", "")
  operands, out, _ = opt_einsum.parser.parse_einsum_input((equation, x, kernel))
  lhs, rhs = operands.split(",")
  try:
    return GemmView(contraction.plan_einsum(lhs, rhs, out, equation))
  except ValueError:  # batched or not a GEMM: the analysis measures it at the model level only
    return None


def _dense_general_view(module: nn.DenseGeneral, x) -> Optional[GemmView]:
  if nn.linear._canonicalize_tuple(module.batch_dims):
    return None
  features = nn.linear._canonicalize_tuple(module.features)
  axis = nn.linear._normalize_axes(nn.linear._canonicalize_tuple(module.axis), x.ndim)
  return GemmView(contraction.plan_dense_general(x.ndim, axis, len(features)))


def gemm_view(module, x: jax.Array, call_kwargs: dict) -> Optional[GemmView]:
  """The GEMM view of one call of a Flax GEMM layer, or None if it has none."""
  if isinstance(module, (nn.Dense, nnx.Linear)):
    return GemmView(contraction.plan_dense_general(x.ndim, (x.ndim - 1,), 1))
  if isinstance(module, nn.DenseGeneral):
    return _dense_general_view(module, x)
  if isinstance(module, (nn.Einsum, nnx.Einsum)):
    kernel = kernel_of(module)
    return _einsum_view(call_kwargs.get("einsum_str") or module.einsum_str, x, kernel)
  return None


def kernel_of(module) -> jax.Array:
  if isinstance(module, nnx.Module):
    return module.kernel[...]
  return nn.unbox(module.get_variable("params", "kernel"))


def promoted(module, x: jax.Array, kernel: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x and the kernel in the dtype the layer computes in (Flax's promote_dtype)."""
  if isinstance(module, nnx.Module):
    x, kernel = module.promote_dtype((x, kernel), dtype=module.dtype)
  else:
    x, kernel = module.promote_dtype(x, kernel, dtype=module.dtype)
  return x, kernel
