"""The cast kernels: one primitive for every family, both usages in one pass.

Inputs: x [M, K]; the rowwise and columnwise global amaxes (the per-tensor FP8 amax or
delayed scale, NVFP4's global amaxes; ignored by MXFP8 and block FP8); the SR seed
(uint32[2] with stochastic rounding, else an unread uint32 scalar). Results, for each
requested usage in order rowwise, columnwise: (data, scale) in the stored layout of
tensor.py; with `config.observe_amax` (delayed scaling) then the input's amax, taken as
the cast reads it. The amaxes the scales come from arrive as arrays, not computed inside,
so that under sharding they are global (kernels/_amax.py pmax-es them) while each device
casts only its own shard.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.core import ShapedArray

from jaxquant.formats import Family
from jaxquant.kernels import _primitive as primitive
from jaxquant.kernels import _sharding as sharding
from jaxquant.kernels._config import CastConfig
from jaxquant.kernels._reference_cast import reference_cast

TARGETS = {
  Family.FP8_TENSOR: "jaxquant_fp8_tensor_cast",
  Family.FP8_BLOCK: "jaxquant_fp8_block_cast",
  Family.MXFP8: "jaxquant_mxfp8_cast",
  Family.NVFP4: "jaxquant_nvfp4_cast",
}


def stored_shape(usage: str, m: int, k: int) -> tuple[int, int]:
  return (m, k) if usage == "rowwise" else (k, m)


def _abstract_eval(x, row_amax, col_amax, seed, *, config: CastConfig):
  m, k = x.shape
  out = []
  for usage in config.usages:
    fmt = config.usage_format(usage)
    rows, cols = stored_shape(usage, m, k)
    out.append(ShapedArray(fmt.data_shape(rows, cols), fmt.storage_dtype))
    out.append(ShapedArray(fmt.scale_shape(rows, cols), fmt.scale_dtype))
  if config.observe_amax:
    out.append(ShapedArray((), jnp.float32))
  return out


def _blocks(config: CastConfig) -> tuple[int, int]:
  """(M extent, K extent) of the blocks a shard must hold whole (and the kernels' 16/32
  alignment): the rowwise block along K, the columnwise block along M."""
  fmt = config.format
  align = 32 if fmt.family is Family.MXFP8 else 16
  if fmt.family is Family.FP8_TENSOR:
    return align, align
  br, bc = fmt.block
  return max(align, bc if config.columnwise else br), max(align, bc)


def _factors(config: CastConfig, m: int, k: int):
  """Each tensor's dims as Shardy factors, and every factor's size.

  M = (mb mi) and K = (kb ki) with mi, ki the block extents, so that a scale dim of M / mi
  is the factor mb; NVFP4's packed dims use a half-size inner factor.
  """
  fmt = config.format
  mi, ki = _blocks(config)
  sizes = dict(mb=m // mi, mi=mi, kb=k // ki, ki=ki, mh=mi // 2, kh=ki // 2, seed=2)
  M, K = ("mb", "mi"), ("kb", "ki")
  packed = fmt.family is Family.NVFP4
  two_d = fmt.block[0] > 1
  dims = {
    "rowwise": (M, ("kb", "kh") if packed else K),
    "columnwise": (K, ("mb", "mh") if packed else M),
  }
  scale_dims = {
    "rowwise": () if fmt.family is Family.FP8_TENSOR else ("mb", "kb") if two_d else (M, "kb"),
    "columnwise": () if fmt.family is Family.FP8_TENSOR else ("kb", "mb") if two_d else (K, "mb"),
  }
  row_amax = (M,) if fmt.row_scaled else ()
  seed = ("seed",) if config.stochastic_rounding else ()
  operands = [(M, K), row_amax, (), seed]
  results = []
  for usage in config.usages:
    results += [dims[usage], scale_dims[usage]]
  if config.observe_amax:
    results.append(())
  return operands, results, sizes


def _whole_blocks(config: CastConfig, m: int, k: int) -> bool:
  mi, ki = _blocks(config)
  return m % mi == 0 and k % ki == 0


def _sharding_rule(config: CastConfig, shapes, mesh_size):
  m, k = shapes[0]
  mi, ki = _blocks(config)
  if not _whole_blocks(config, m, k) or (m // mi) % mesh_size or (k // ki) % mesh_size:
    # Partial edge blocks (block FP8), or fewer blocks than an even split over the devices
    # needs (Shardy would split a mesh axis to shard them, which `partition` cannot take):
    # keep the tensor whole.
    seed = ("seed",) if config.stochastic_rounding else ()
    operands = [("m", "k"), ("r",) if config.format.row_scaled else (), (), seed]
    results = [
      tuple(f"o{i}_{d}" for d in range(len(s)))
      for i, s in enumerate(
        _abstract_eval(ShapedArray((m, k), jnp.float32), None, None, None, config=config)
      )
    ]
    names = {f for t in operands + results for f in t}
    return sharding.rule(operands, results, {}, need_replication_factors=tuple(sorted(names)))
  operands, results, sizes = _factors(config, m, k)
  replicated = ("seed",) if config.stochastic_rounding else ()
  return sharding.rule(operands, results, sizes, need_replication_factors=replicated)


def partition(config: CastConfig, mesh, arg_shapes, result_shape):
  m, k = arg_shapes[0].shape
  mi, ki = _blocks(config)
  m_axes, k_axes = sharding.spec_axes(arg_shapes[0].sharding, 2)
  m_axes = sharding.keep_if_whole(mesh, m_axes, m, mi)
  k_axes = sharding.keep_if_whole(mesh, k_axes, k, ki)
  per_tensor = config.format.family is Family.FP8_TENSOR
  arg_specs = [
    sharding.pspec(m_axes, k_axes),
    sharding.pspec(m_axes) if config.format.row_scaled else sharding.pspec(),
    sharding.pspec(),
    sharding.pspec(),
  ]
  result_specs = []
  for usage in config.usages:
    data = (m_axes, k_axes) if usage == "rowwise" else (k_axes, m_axes)
    result_specs += [
      sharding.pspec(*data),
      sharding.pspec() if per_tensor else sharding.pspec(*data),
    ]
  if config.observe_amax:
    result_specs.append(sharding.pspec())
  sharded_axes = m_axes + k_axes

  def local(kernel, x, row_amax, col_amax, seed):
    if config.stochastic_rounding and sharded_axes:
      # Each shard counts its elements from zero: give each its own random stream.
      seed = seed + jnp.stack([jnp.uint32(0), sharding.shard_index(mesh, sharded_axes)])
    outs = list(kernel(x, row_amax, col_amax, seed))
    if config.observe_amax:  # the shard's amax: the tensor's is the max over the shards
      outs[-1] = sharding.pmax_amax(outs[-1], sharded_axes)
    return outs

  return arg_specs, result_specs, local


SPEC = primitive.KernelSpec(
  name="jaxquant_cast",
  abstract_eval=_abstract_eval,
  reference=reference_cast,
  partition=partition,
  sharding_rule=_sharding_rule,
  ffi_targets=tuple(TARGETS.values()),
  pick_target=lambda config: TARGETS[config.format.family],
)
cast_p = primitive.define(SPEC)
