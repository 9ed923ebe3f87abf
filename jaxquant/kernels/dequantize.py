"""Dequantize kernel: one usage's stored data and scales back to a high-precision matrix.

The result is in the stored layout ([K, M] for columnwise data); `jaxquant.ops` turns it
back into the logical shape. Bits equal `reference.dequantize_data(...).astype(dtype)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src.core import ShapedArray

from jaxquant.formats import Family
from jaxquant.kernels import primitive, sharding
from jaxquant.kernels.config import KernelConfig
from jaxquant.kernels.validate import check_array
from jaxquant import reference
from jaxquant.tensor import QuantizedData


def _stored(data, config):
  rows, cols = data.shape
  return rows, cols * 2 if config.format.packed else cols


def _abstract_eval(data, scale, amax, *, config):
  return [ShapedArray(_stored(data, config), jnp.dtype(config.out_dtype))]


def _reference(data, scale, amax, *, config):
  has_amax = config.format.family is Family.NVFP4
  qd = QuantizedData(data, scale, amax if has_amax else None, config.format)
  return [reference.dequantize_data(qd).astype(config.out_dtype)]


# Kept whole: dequantize is not on a sharded hot path yet (see notes/kernels.md).
_partition, _sharding_rule = sharding.kept_whole(3)


dequantize_p = primitive.define(primitive.KernelSpec(
    name="jaxquant_dequantize", ffi_target=lambda config: "jaxquant_dequantize",
    abstract_eval=_abstract_eval, reference=_reference, partition=_partition,
    sharding_rule=_sharding_rule))


def dequantize_data(qd: QuantizedData, dtype) -> jax.Array:
  """One usage back to `dtype`, in its stored layout."""
  fmt = qd.format
  rows, cols = qd.stored_shape
  if cols % 16:
    raise ValueError(f"dequantize kernel: stored cols = {cols} must be a multiple of 16")
  check_array(qd.data, "dequantize data", fmt.data_shape(rows, cols), fmt.storage_dtype)
  check_array(qd.scale_inv, "dequantize scales", fmt.scale_shape(rows, cols), fmt.scale_dtype)
  amax = jnp.zeros((), jnp.float32)
  if fmt.family is Family.NVFP4:
    check_array(qd.amax, "dequantize global amax", (rows,) if fmt.row_scaled else (), jnp.float32)
    amax = qd.amax
  config = KernelConfig(format=fmt, out_dtype=jnp.dtype(dtype).name)
  return dequantize_p.bind(qd.data, qd.scale_inv, amax, config=config)[0]
