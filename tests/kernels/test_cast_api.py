"""kernels.cast and kernels.cast_amaxes: the cast alone, its scalar operands given, is
quantize_usages split in two, through the primitive or its pure-JAX lowering alike (on a GPU
too, stochastic rounding aside)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxquant import kernels
from jaxquant.quantizers import (
  BlockFloat8Quantizer,
  DelayedFloat8Quantizer,
  Float8Quantizer,
  MXFP8Quantizer,
  NVFP4Quantizer,
)

BOTH = ("rowwise", "columnwise")


def _bits(tree):
  return [np.asarray(leaf).reshape(-1).view(np.uint8) for leaf in jax.tree.leaves(tree)]


@pytest.mark.parametrize(
  "quantizer",
  [
    Float8Quantizer(),
    DelayedFloat8Quantizer(),
    BlockFloat8Quantizer(),
    MXFP8Quantizer(),
    NVFP4Quantizer(per_token=True),
    NVFP4Quantizer(rht=True, stochastic_rounding=True),
  ],
  ids=repr,
)
def test_cast_with_its_amaxes_is_quantize_usages(quantizer):
  x = jax.random.normal(jax.random.key(1), (64, 256), jnp.bfloat16) * 3
  usages = ("rowwise",) if getattr(quantizer, "per_token", False) else BOTH
  key, scale = jax.random.key(2), jnp.float32(5.0)

  @jax.jit  # one compilation, not one per op of the reference
  def three_ways(x, key, scale):
    row_amax, col_amax = kernels.cast_amaxes(x, quantizer, usages, scale=scale)
    kernel = kernels.cast(x, quantizer, usages, row_amax, col_amax, key=key)
    reference = kernels.cast(
      x, quantizer, usages, row_amax, col_amax, key=key, implementation="reference"
    )
    composed = kernels.quantize_usages_and_amax(x, quantizer, usages, key=key, scale=scale)
    return kernel, reference, composed

  kernel, reference, composed = three_ways(x, key, scale)
  # Stochastic rounding draws its bits from the CUDA kernel's own stream on a GPU: there the
  # reference lowering gives other (equally distributed) codes.
  stochastic = getattr(quantizer, "stochastic_rounding", False)
  for got in (
    (composed,) if stochastic and jax.default_backend() == "gpu" else (reference, composed)
  ):
    for a, b in zip(_bits(kernel), _bits(got), strict=True):
      np.testing.assert_array_equal(a, b)


def test_cast_names_a_bad_implementation():
  x = jnp.ones((32, 32), jnp.bfloat16)
  zero = jnp.zeros((), jnp.float32)
  with pytest.raises(ValueError, match="implementation='xla'"):
    kernels.cast(x, MXFP8Quantizer(), BOTH, zero, zero, implementation="xla")
