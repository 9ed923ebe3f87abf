"""NVFP4's decode scale S_dec of global amaxes (NUMERICS.md, NVFP4 step 2), by a kernel.

The GEMM of two NVFP4 operands multiplies its fp32 sums by both operands' S_dec. Exact
fp32 division is one instruction in CUDA and an integer emulation in XLA code
(`reference.fp32.div`: XLA:GPU divides approximately), which a train step inlined for
every GEMM and whose size set most of the step's compile time. Elementwise: each device
takes the S_decs of its shard of amaxes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.core import ShapedArray

from jaxquant.kernels import _primitive as primitive
from jaxquant.kernels import _sharding as sharding
from jaxquant.kernels._validate import check_array
from jaxquant.reference import _nvfp4 as nvfp4


@dataclasses.dataclass(frozen=True)
class DecodeScaleConfig:
  """No options: the kernel's one form (primitives take a hashable config)."""

  def ffi_attributes(self) -> dict:
    return {}


def _abstract_eval(amax, *, config):
  return [ShapedArray(amax.shape, jnp.float32)]


def _reference(amax, *, config):
  return [nvfp4.global_scales(amax)[1]]


_partition, _sharding_rule = sharding.elementwise(1)


SPEC = primitive.KernelSpec(
  name="jaxquant_nvfp4_decode_scale",
  abstract_eval=_abstract_eval,
  reference=_reference,
  partition=_partition,
  sharding_rule=_sharding_rule,
)
decode_scale_p = primitive.define(SPEC)


def decode_scale(amax: jax.Array) -> jax.Array:
  """The S_dec of fp32 global amaxes (a scalar or a vector), bit for bit
  `reference.nvfp4.global_scales(amax)[1]`."""
  check_array(amax, "NVFP4 global amax", amax.shape, jnp.float32)
  if amax.ndim > 1:
    raise ValueError(f"NVFP4 global amax: a scalar or a vector, got shape {amax.shape}")
  return decode_scale_p.bind(amax, config=DecodeScaleConfig())[0]
