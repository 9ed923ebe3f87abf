"""Operand preparation: the weight's usages cast from the [K, N] kernel itself equal, bit for
bit, those cast from its transpose w = kernel.T (ops/_operands.py,
quantize_transposed_operand), for every quantizer, whichever route it takes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxquant import scaling
from jaxquant.ops import _operands as ops_operands
from jaxquant.quantizers import (
  BlockFloat8Quantizer,
  DelayedFloat8Quantizer,
  Float8Quantizer,
  HybridQuantizer,
  MXFP8Quantizer,
  NVFP4Quantizer,
)

QUANTIZERS = {  # (quantizer, cast from the kernel without a transpose)
  "fp8": (Float8Quantizer(), True),
  "fp8_delayed": (DelayedFloat8Quantizer(history_len=4), True),
  "block_1x128": (BlockFloat8Quantizer(), True),
  "block_128x128": (BlockFloat8Quantizer(block="128x128"), True),
  "mxfp8_e5m2": (MXFP8Quantizer("e5m2"), True),
  "nvfp4": (NVFP4Quantizer(), True),
  "nvfp4_16x16": (NVFP4Quantizer(tile_2d=True), True),
  "nvfp4_rht": (NVFP4Quantizer(rht=True), False),
  "nvfp4_sr": (NVFP4Quantizer(stochastic_rounding=True), False),
  "hybrid": (HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer()), False),
  "high_precision": (None, False),
}


def _bits(tree):
  return [
    np.asarray(leaf).view(f"u{np.asarray(leaf).dtype.itemsize}") for leaf in jax.tree.leaves(tree)
  ]


@pytest.mark.parametrize("name", list(QUANTIZERS))
@pytest.mark.slow
def test_transposed_operand_is_the_transposes_operand(name):
  quantizer, direct = QUANTIZERS[name]
  assert ops_operands.treats_usages_alike(quantizer) == direct
  rng = np.random.default_rng(0)
  kernel = jnp.asarray(
    rng.standard_normal((256, 384)) * np.exp2(rng.integers(-4, 4, (1, 384))), jnp.float32
  )  # [K, N], blocks differ across N
  key = jax.random.key(1)
  state = scaling.init_state(quantizer) if isinstance(quantizer, DelayedFloat8Quantizer) else None
  for usages in (("rowwise",), ("rowwise", "columnwise")):
    got = ops_operands.quantize_transposed_operand(kernel, quantizer, usages, key=key, state=state)
    want = ops_operands.quantize_operand(kernel.T, quantizer, usages, key=key, state=state)
    assert set(got[0]) == set(usages)
    got_bits, want_bits = _bits(got), _bits(want)
    assert len(got_bits) == len(want_bits)
    for g, w in zip(got_bits, want_bits, strict=False):
      np.testing.assert_array_equal(g, w)
