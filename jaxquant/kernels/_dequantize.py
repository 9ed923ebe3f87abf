"""Dequantize kernel: one usage's stored data and scales back to a high-precision matrix.

The result is in the stored layout ([K, M] for columnwise data); `jaxquant.ops` turns it
back into the logical shape. Bits equal `reference.dequantize_data(...).astype(dtype)`, or
with `block_scales_only` the block-scaled values of `reference.split_scales` (the NVFP4
S_dec left for a GEMM's epilogue).

Under a sharded jit each device dequantizes its shard: rows and columns stay sharded
wherever every shard holds whole scaling blocks, and are gathered otherwise.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jaxquant import reference
from jaxquant.formats import Family, Format
from jaxquant.kernels import _primitive as primitive
from jaxquant.kernels import _sharding as sharding
from jaxquant.kernels._config import format_attributes
from jaxquant.kernels._validate import check_array
from jaxquant.tensor import QuantizedData


@dataclasses.dataclass(frozen=True)
class DequantizeConfig:
  """The stored usage's format and the result's dtype (which the result buffer says on the
  C++ side, so it is no attribute); ffi/cast/dequantize.cu decodes the struct of the same
  name."""

  format: Format
  out_dtype: str
  block_scales_only: bool = False  # leave the outer scale (NVFP4's S_dec) out

  def ffi_attributes(self) -> dict:
    return dict(
      **format_attributes(self.format), block_scales_only=np.int32(self.block_scales_only)
    )


def _stored(data, config):
  rows, cols = data.shape
  return rows, cols * 2 if config.format.packed else cols


def _abstract_eval(data, scale, amax, *, config):
  return [ShapedArray(_stored(data, config), jnp.dtype(config.out_dtype))]


def _reference(data, scale, amax, *, config):
  has_amax = config.format.family is Family.NVFP4
  qd = QuantizedData(data, scale, amax if has_amax else None, config.format)
  if config.block_scales_only:
    values = reference.split_scales(qd)[0]
  else:
    values = reference.dequantize_data(qd)
  return [values.astype(config.out_dtype)]


def _block(fmt: Format) -> tuple[int, int]:
  """The scaling block (rows, cols) of the stored layout; per-tensor FP8 has none."""
  return (1, 1) if fmt.family is Family.FP8_TENSOR else fmt.block


def _sharding_rule(config, shapes, mesh_size):
  """Rows and columns of data, scales and result are one factor each where blocks are 1
  wide along that dim; elsewhere a (blocks, within a block) compound whose minor part is
  never sharded, so that a shard holds whole blocks. A dim whose number of blocks the
  device count does not divide stays whole: Shardy would otherwise split a mesh axis to
  shard it, a sharding that `partition` cannot be handed."""
  fmt = config.format
  (rows, data_cols), scale_shape, amax_shape = shapes
  block_rows, block_cols = _block(fmt)
  cols = data_cols * 2 if fmt.packed else data_cols
  sizes, whole = {}, []

  def dim(name, size, block, stored_block):
    """(stored data dim, result dim, scale dim) factors of one dim."""
    if block == 1:
      return name, name, name
    if size % block or (size // block) % mesh_size:  # partial or too few blocks
      whole.extend([name + "d", name + "r", name + "s"])
      return name + "d", name + "r", name + "s"
    inner_d, inner_r = name + "_stored_in_block", name + "_in_block"
    sizes.update({inner_d: stored_block, inner_r: block})
    whole.extend([inner_r, inner_d])
    return (name + "s", inner_d), (name + "s", inner_r), name + "s"

  row_d, row_r, row_s = dim("r", rows, block_rows, block_rows)
  col_d, col_r, col_s = dim("c", cols, block_cols, block_cols // 2 if fmt.packed else block_cols)
  scale = (row_s, col_s) if scale_shape else ()
  amax = (row_d,) if amax_shape else ()  # per-token S_dec: one per stored row (1-D blocks)
  operands = [(row_d, col_d), scale, amax]
  names = dict.fromkeys(
    f for t in (*operands, (row_r, col_r)) for d in t for f in (d if isinstance(d, tuple) else (d,))
  )
  replicated = tuple(f for f in names if f in whole)
  return sharding.rule(operands, [(row_r, col_r)], sizes, need_replication_factors=replicated)


def _partition(config, mesh, arg_shapes, result_shape):
  fmt = config.format
  block_rows, block_cols = _block(fmt)
  rows, data_cols = arg_shapes[0].shape
  row_axes, col_axes = sharding.spec_axes(arg_shapes[0].sharding, 2)
  row_axes = sharding.keep_if_whole(mesh, row_axes, rows, block_rows)
  stored_block_cols = block_cols // 2 if fmt.packed and block_cols > 1 else block_cols
  col_axes = sharding.keep_if_whole(mesh, col_axes, data_cols, stored_block_cols)
  data_spec = sharding.pspec(row_axes, col_axes)
  scale_spec = data_spec if arg_shapes[1].shape else sharding.pspec()
  amax_spec = sharding.pspec(row_axes) if arg_shapes[2].shape else sharding.pspec()
  return ([data_spec, scale_spec, amax_spec], [data_spec], lambda kernel, *shards: kernel(*shards))


SPEC = primitive.KernelSpec(
  name="jaxquant_dequantize",
  abstract_eval=_abstract_eval,
  reference=_reference,
  partition=_partition,
  sharding_rule=_sharding_rule,
)
dequantize_p = primitive.define(SPEC)


def dequantize_data(qd: QuantizedData, dtype, *, block_scales_only: bool = False) -> jax.Array:
  """One usage back to `dtype`, in its stored layout. `block_scales_only` leaves the
  outer scale (`reference.outer_scale`, NVFP4's S_dec) out: the values a GEMM multiplies.
  MXFP8 and block FP8 have no outer scale; per-tensor FP8 has only that one (refused)."""
  fmt = qd.format
  rows, cols = qd.stored_shape
  if cols % 16:
    raise ValueError(f"dequantize kernel: stored cols = {cols} must be a multiple of 16")
  if block_scales_only and fmt.family is Family.FP8_TENSOR:
    raise ValueError(
      "dequantize kernel: block_scales_only needs block scales; per-tensor FP8 "
      "has only its outer scale"
    )
  check_array(qd.data, "dequantize data", fmt.data_shape(rows, cols), fmt.storage_dtype)
  check_array(qd.scale_inv, "dequantize scales", fmt.scale_shape(rows, cols), fmt.scale_dtype)
  amax = jnp.zeros((), jnp.float32)
  if fmt.family is Family.NVFP4 and not block_scales_only:
    check_array(qd.amax, "dequantize global amax", (rows,) if fmt.row_scaled else (), jnp.float32)
    amax = qd.amax
  config = DequantizeConfig(fmt, jnp.dtype(dtype).name, block_scales_only)
  return dequantize_p.bind(qd.data, qd.scale_inv, amax, config=config)[0]
