"""Delayed scaling's next scale of each amax (NUMERICS.md, "Delayed scaling"), by a kernel.

`scaling.next_scale`: fmax / amax / 2^margin in exact fp32 divisions, the old scale kept
where amax is zero or not finite. An IEEE fp32 division is one instruction in CUDA and an
integer emulation in XLA code (`reference.fp32.div`: XLA:GPU divides approximately), which
a delayed-scaling train step inlined once for every group of states it updates, and which
made up most of the operations the update adds to the step. Elementwise: each device
takes the scales of its shard of amaxes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jaxquant import scaling
from jaxquant.kernels import _primitive as primitive
from jaxquant.kernels import _sharding as sharding
from jaxquant.kernels._validate import check_array


@dataclasses.dataclass(frozen=True)
class DelayedScaleConfig:
  """The format's largest finite value and 2^margin (primitives take a hashable config)."""

  fmax: float
  divisor: float

  def ffi_attributes(self) -> dict:
    return dict(fmax=np.float32(self.fmax), divisor=np.float32(self.divisor))


def _abstract_eval(amax, scale, *, config):
  return [ShapedArray(scale.shape, jnp.float32)]


def _reference(amax, scale, *, config):
  return [scaling.next_scale(amax, scale, config.fmax, config.divisor)]


_partition, _sharding_rule = sharding.elementwise(2)


SPEC = primitive.KernelSpec(
  name="jaxquant_delayed_scale",
  abstract_eval=_abstract_eval,
  reference=_reference,
  partition=_partition,
  sharding_rule=_sharding_rule,
)
delayed_scale_p = primitive.define(SPEC)


def delayed_scale(amax: jax.Array, scale: jax.Array, fmax: float, divisor: float) -> jax.Array:
  """`scaling.next_scale(amax, scale, fmax, divisor)`, bit for bit: fp32 amaxes and scales of
  one shape (a scalar or a vector)."""
  check_array(amax, "delayed-scaling amax", amax.shape, jnp.float32)
  check_array(scale, "delayed scale", amax.shape, jnp.float32)
  if amax.ndim > 1:
    raise ValueError(f"delayed-scaling amax: a scalar or a vector, got shape {amax.shape}")
  return delayed_scale_p.bind(amax, scale, config=DelayedScaleConfig(float(fmax), float(divisor)))[
    0
  ]
