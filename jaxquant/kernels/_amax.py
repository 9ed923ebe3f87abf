"""The amaxes the casts take: kernels for max |x| per tensor, per row, or of the
Hadamard-transformed columnwise data, and `tensor_amax`, the per-tensor amax as an XLA
reduction, which the casts use.

Under sharding, each device takes the amax of its shard and the partitioned implementation
combines them with an exact pmax, so every device holds the global amax (XLA does the same
for `tensor_amax` itself).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jaxquant.kernels import _primitive as primitive
from jaxquant.kernels import _sharding as sharding
from jaxquant.kernels._validate import check_matrix
from jaxquant.reference import _fp32 as fp32
from jaxquant.reference import _hadamard as hadamard


@dataclasses.dataclass(frozen=True)
class AmaxConfig:
  """Which amax: per row instead of per tensor, or of the Hadamard-transformed columnwise
  data (per tensor); ffi/cast/amax.cu decodes the struct of the same name."""

  per_row: bool = False
  rht: bool = False

  def ffi_attributes(self) -> dict:
    return dict(per_row=np.int32(self.per_row), rht=np.int32(self.rht))


def _abstract_eval(x, *, config):
  return [ShapedArray((x.shape[0],) if config.per_row else (), jnp.float32)]


def _reference(x, *, config):
  xf = x.astype(jnp.float32)
  if config.rht:
    return [fp32.abs_max(hadamard.apply_rht(xf.T, x.dtype))]
  return [fp32.abs_max(xf, axis=1) if config.per_row else fp32.abs_max(xf)]


def _partition(config, mesh, arg_shapes, result_shape):
  (m, k) = arg_shapes[0].shape
  m_axes, k_axes = sharding.spec_axes(arg_shapes[0].sharding, 2)
  m_axes = sharding.keep_if_whole(mesh, m_axes, m, 16 if config.rht else 1)
  k_axes = sharding.keep_if_whole(mesh, k_axes, k, 16)
  arg_specs = [sharding.pspec(m_axes, k_axes)]
  if config.per_row:
    result_specs = [sharding.pspec(m_axes)]
    reduced = k_axes
  else:
    result_specs = [sharding.pspec()]
    reduced = m_axes + k_axes

  def local(kernel, x):
    return [sharding.pmax_amax(kernel(x)[0], reduced)]

  return arg_specs, result_specs, local


def _sharding_rule(config, shapes, mesh_size):
  if config.per_row:
    return sharding.rule([("m", "k")], [("m",)], {}, reduction_factors=("k",))
  return sharding.rule([("m", "k")], [()], {}, reduction_factors=("m", "k"))


SPEC = primitive.KernelSpec(
  name="jaxquant_amax",
  abstract_eval=_abstract_eval,
  reference=_reference,
  partition=_partition,
  sharding_rule=_sharding_rule,
)
amax_p = primitive.define(SPEC)


def amax(x: jax.Array, *, per_row: bool = False, rht: bool = False) -> jax.Array:
  """amax of a [M, K] matrix: fp32 () or [M] (per_row); with rht, of RHT(x.T) (NVFP4's
  columnwise data), per tensor."""
  if per_row and rht:
    raise ValueError("amax: the RHT amax is per tensor (per_row=True and rht=True given)")
  check_matrix(x, "amax", rows_multiple=16 if rht else 1, cols_multiple=16)
  return amax_p.bind(x, config=AmaxConfig(per_row=per_row, rht=rht))[0]


def tensor_amax(x: jax.Array) -> jax.Array:
  """max |x| over all of x, as fp32 (NaN propagates), by an XLA reduction instead of the
  amax kernel: XLA fuses the reduction into the op that produces x (a norm, an activation,
  a residual add), so x is not read again for it: the faster train step
  (docs/benchmarks.md, "Where quantization runs"). Of x's own values (`fp32.widen`): from
  `x.astype(float32)`, XLA:GPU may merge that convert with the producer's rounding to x's
  dtype and take the amax of unrounded values, which the cast never sees."""
  return fp32.abs_max(fp32.widen(x))
