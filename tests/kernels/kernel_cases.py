"""Shared helpers for the kernel tests: quantizers, inputs, bit comparison, GEMM error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.quantizers import (
  BlockFloat8Quantizer,
  DelayedFloat8Quantizer,
  Float8Quantizer,
  HybridQuantizer,
  MXFP8Quantizer,
  NVFP4Quantizer,
)

QUANTIZERS = {
  "fp8_e4m3": Float8Quantizer(),
  "fp8_e5m2_pow2_eps": Float8Quantizer("e5m2", eps=1e-3, pow2_scales=True),
  "block_1x128": BlockFloat8Quantizer(),
  "block_128x128": BlockFloat8Quantizer(block="128x128"),
  "block_1x128_e5m2_nopow2": BlockFloat8Quantizer("e5m2", pow2_scales=False),
  "mxfp8_e4m3": MXFP8Quantizer(),
  "mxfp8_e5m2": MXFP8Quantizer("e5m2"),
  "nvfp4": NVFP4Quantizer(),
  "nvfp4_16x16": NVFP4Quantizer(tile_2d=True),
  "nvfp4_rht": NVFP4Quantizer(rht=True),
  "nvfp4_per_token": NVFP4Quantizer(per_token=True),
  "nvfp4_per_token_rht": NVFP4Quantizer(rht=True, per_token=True),
  "hybrid_mxfp8_nvfp4": HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(rht=True)),
}
SR_QUANTIZERS = {
  "nvfp4_sr": NVFP4Quantizer(stochastic_rounding=True),
  "nvfp4_rht_sr": NVFP4Quantizer(rht=True, stochastic_rounding=True),
  "nvfp4_16x16_sr": NVFP4Quantizer(tile_2d=True, stochastic_rounding=True),
}
DELAYED = DelayedFloat8Quantizer()


def bits(a) -> np.ndarray:
  """An array's bits as unsigned integers, every NaN made the canonical fp32 NaN."""
  a = np.asarray(a)
  if a.dtype == np.float32:
    return np.where(np.isnan(a), np.uint32(0x7FC00000), a.view(np.uint32))
  width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
  return a.view(width)


def assert_same_bits(got, want, what: str) -> None:
  got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves), (
    f"{what}: {len(got_leaves)} vs {len(want_leaves)} arrays"
  )
  for i, (g, w) in enumerate(zip(got_leaves, want_leaves, strict=False)):
    g, w = bits(g), bits(w)
    assert g.shape == w.shape, f"{what}[{i}]: shape {g.shape} != {w.shape}"
    # 1-D at least: np.argwhere of a 0-d comparison is empty whatever its value.
    g, w = np.atleast_1d(g), np.atleast_1d(w)
    bad = np.argwhere(g != w)
    assert bad.size == 0, (
      f"{what}[{i}]: {len(bad)} of {g.size} differ, first at {tuple(bad[0])}: "
      f"{g[tuple(bad[0])]:#x} vs {w[tuple(bad[0])]:#x}"
    )


def random_input(seed: int, shape, dtype) -> jax.Array:
  """Normal values with a spread of magnitudes (several decades) so blocks differ."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  x *= np.exp2(rng.integers(-8, 8, size=(shape[0], 1))).astype(np.float32)
  return jnp.asarray(x, dtype)


def edge_input(shape, dtype, *, nan: bool, inf: bool) -> jax.Array:
  """NUMERICS.md's edge cases in one matrix: zero rows and blocks, subnormals, negative
  zero, exact ties for FP8 (block amax 448: scale 1), optional +-inf and NaN."""
  x = np.array(random_input(7, shape, np.float32))  # a writable copy
  x[0] = 0.0  # all-zero row (and blocks)
  x[1] = -0.0  # negative zeros
  x[2] = np.float32(2.0**-133) * np.arange(shape[1])  # fp32 subnormals
  x[3] = np.float32(2.0**-128)  # one subnormal magnitude everywhere
  x[4, :] = 1.0625  # E4M3 ties between 1 and 1.125 ...
  x[4, ::32] = 448.0  # ... with scale exactly 1 per block
  x[5] = np.tile(np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]), shape[1] // 8)
  x[6] = np.float32(1e-30)  # tiny but normal, huge scales
  if inf:
    x[7, 3] = np.inf
    x[8, 5] = -np.inf
  if nan:
    x[9, 7] = np.nan
  return jnp.asarray(x, dtype)


# GEMM kernels against the reference (docs/numerics.md). Hopper's FP8 MMA adds the 32 products
# of one instruction with about 14 bits of alignment before the fp32 promotion, so FP8 x FP8
# on FP8 tensor cores is not fp32-exact (cuBLASLt's FP8 GEMM is not either); bf16 products
# accumulate in fp32 and meet the reference emulation's 1e-5.
FP8_MMA_TOLERANCE = 2.0**-12
BF16_MMA_TOLERANCE = 1e-5


def relative_error(got, want) -> float:
  """Normwise relative error of a GEMM result against a float64 oracle."""
  got = np.asarray(got, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
