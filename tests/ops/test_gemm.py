"""The GEMM dispatch's bf16 route: which operands it narrows, and that narrowing is exact.

On a GPU, `gemm` feeds block-scaled operands to bf16 tensor cores when their values are
exact in bf16 (fp32 accumulation either way). The claim is checked here on the values
themselves, so it holds on every platform, not only where the route runs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxquant import reference
from jaxquant.ops import _gemm as gemm_lib
from jaxquant.quantizers import (
  BlockFloat8Quantizer,
  Float8Quantizer,
  MXFP8Quantizer,
  NVFP4Quantizer,
)

NARROWED = {
  "fp8_tensor": Float8Quantizer(),
  "fp8_block_1x128_pow2": BlockFloat8Quantizer(),
  "fp8_block_128x128_pow2": BlockFloat8Quantizer(block="128x128"),
  "fp8_block_e5m2_pow2": BlockFloat8Quantizer("e5m2"),
  "mxfp8_e4m3": MXFP8Quantizer(),
  "mxfp8_e5m2": MXFP8Quantizer("e5m2"),
  "nvfp4": NVFP4Quantizer(),
  "nvfp4_16x16": NVFP4Quantizer(tile_2d=True),
  "nvfp4_per_token": NVFP4Quantizer(per_token=True),
}


def _quantize_rowwise(x, quantizer):
  return jax.jit(lambda x: reference.quantize(x, quantizer, ("rowwise",)).rowwise)(x)


def _wide_range_matrix(seed, shape=(128, 256)):
  """Normal values times 2^e for e in [-40, 40] by row: block scales far from 1."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  exponents = jax.random.randint(k1, (shape[0], 1), -40, 41).astype(jnp.float32)
  return jax.random.normal(k2, shape, jnp.float32) * jnp.exp2(exponents)


@pytest.mark.parametrize("name", sorted(NARROWED))
def test_narrowed_operands_are_exact_in_bf16(name):
  qd = _quantize_rowwise(_wide_range_matrix(1), NARROWED[name])
  assert gemm_lib._exact_in_bf16(qd)
  values, _ = reference.split_scales(qd)
  values = np.asarray(values, np.float32)
  round_trip = values.astype(jnp.bfloat16).astype(np.float32)
  np.testing.assert_array_equal(round_trip.view(np.uint32), values.view(np.uint32))


def test_block_fp8_with_fp32_scales_is_not_narrowed():
  qd = _quantize_rowwise(_wide_range_matrix(2), BlockFloat8Quantizer(pow2_scales=False))
  assert not gemm_lib._exact_in_bf16(qd)
  values, _ = reference.split_scales(qd)
  values = np.asarray(values, np.float32)
  # The reason: an fp32 scale gives values that bf16 cannot hold.
  assert np.any(values.astype(jnp.bfloat16).astype(np.float32) != values)


# Block FP8 (the newest member of the route) and per-token NVFP4 (outer scales per row).
@pytest.mark.parametrize("name", ["fp8_block_1x128_pow2", "nvfp4_per_token"])
def test_bf16_route_matches_reference(name):
  a = _quantize_rowwise(_wide_range_matrix(3), NARROWED[name])
  b = _quantize_rowwise(jax.random.normal(jax.random.key(4), (64, 256)), NARROWED[name])
  narrow = jax.jit(lambda a, b: gemm_lib.emulated_gemm(a, b, narrow=True))(a, b)
  wide = jax.jit(gemm_lib.reference_gemm)(a, b)
  # Same products, fp32 sums in another order: relative to each row's norm.
  err = jnp.linalg.norm(narrow - wide, axis=1) / jnp.linalg.norm(wide, axis=1)
  assert float(err.max()) <= 1e-5


def test_values_operands_take_values_only():
  """NVFP4 values (`ScaledValues`) multiply values (NVFP4's, or MXFP8's bf16), never codes,
  and the contraction dims must agree; the reference route is XLA's dot of the values with
  the S_decs after the sum."""
  from jaxquant.kernels._gemm_values import ScaledValues, nvfp4_values

  x = _wide_range_matrix(3)
  a = nvfp4_values(x, NVFP4Quantizer(), ("rowwise",))["rowwise"]
  codes = _quantize_rowwise(x, NVFP4Quantizer())
  with pytest.raises(TypeError, match="multiply NVFP4 or MXFP8 values, not codes"):
    gemm_lib.gemm(a, codes)
  with pytest.raises(ValueError, match="contraction dims differ: A has k=256, B has k=128"):
    gemm_lib.gemm(a, ScaledValues(a.values[:, :128], a.amax))
  got = gemm_lib.gemm(a, a, implementation="reference")
  want = gemm_lib.reference_gemm(codes, codes)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
