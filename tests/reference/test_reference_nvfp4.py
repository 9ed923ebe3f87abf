"""NVFP4 (1-D blocks, 16x16 tiles, RHT, stochastic rounding, per-token) against the oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import numpy_oracle as orc
import pytest
import ref_cases as rc

from jaxquant.quantizers import NVFP4Quantizer
from jaxquant.reference import _nvfp4 as nvfp4

SQUARE = (128, 128)
KEY = jax.random.key(1234)
CASES = [
  (NVFP4Quantizer(), "bf16"),
  (NVFP4Quantizer(), "fp16"),
  (NVFP4Quantizer(), "fp32"),
  (NVFP4Quantizer(tile_2d=True), "bf16"),
  (NVFP4Quantizer(tile_2d=True), "fp32"),
  (NVFP4Quantizer(per_token=True), "fp16"),
  (NVFP4Quantizer(per_token=True, rht=True), "bf16"),
  (NVFP4Quantizer(rht=True), "fp32"),
  (NVFP4Quantizer(rht=True, stochastic_rounding=True), "bf16"),
  (NVFP4Quantizer(stochastic_rounding=True), "fp32"),
]


@pytest.mark.parametrize("q,dt", CASES, ids=lambda v: str(v))
def test_nvfp4_edge_cases(q, dt):
  rng = np.random.default_rng(21)
  dtype = rc.DTYPES[dt]
  cases = rc.edge_suite(rng, SQUARE, dtype, "e2m1", 16, 6.0, anchor=2688.0)
  for name, x in cases.items():
    rc.check_against_oracle(x, q, key=KEY, label=name)
    rc.check_against_oracle(np.ascontiguousarray(x.T), q, key=KEY, label=name + ".T")


@pytest.mark.parametrize(
  "shape,usages",
  [
    ((32, 256), rc.USAGES),
    ((3, 5, 64), ("rowwise",)),
    ((0, 64), rc.USAGES),
    ((128, 384), rc.USAGES),
  ],
)
def test_nvfp4_shapes(shape, usages):
  rng = np.random.default_rng(22)
  rc.check_against_oracle(rc.random_input(rng, shape, rc.DTYPES["bf16"]), NVFP4Quantizer(), usages)


def test_nvfp4_tiny_global_amax():
  """Subnormal global amaxes (S_enc clamps to FLT_MAX) and tiny normal ones (S_dec is
  subnormal), per tensor and per token (each row its own tiny amax)."""
  rng = np.random.default_rng(23)
  base = rng.uniform(-1, 1, SQUARE).astype(np.float32)
  for g in (2.0**-149, 3e-42, 1e-39, 2.0**-126, 2.0**-120, 3e-35, 2688 / 3.4e38):
    x = base * np.float32(g)
    x[7, 9] = np.float32(g)
    for q in (NVFP4Quantizer(), NVFP4Quantizer(per_token=True), NVFP4Quantizer(tile_2d=True)):
      rc.check_against_oracle(x, q, label=f"g={g}")
  rows = np.exp2(rng.uniform(-149, -100, (128, 1))).astype(np.float32)
  rc.check_against_oracle(base * rows, NVFP4Quantizer(per_token=True), label="per-row tiny")
  rc.check_against_oracle(
    rc.subnormals(rng, SQUARE, rc.DTYPES["bf16"]).astype(np.float32),
    NVFP4Quantizer(per_token=True),
    label="bf16 subnormals",
  )


def test_nvfp4_nan_inf_conventions():
  """NaN global amax: every scale byte 0x7F and every code 0 in its domain (the tensor, or
  the row for per-token); inf (no NaN): S_enc = 1 and the data saturates to +-6; -0 and
  negatives that round to zero keep the sign (code 8)."""
  x = np.full(SQUARE, 0.5, np.float32)
  x[0, :4] = [np.inf, -np.inf, -0.0, -1e-3]
  qt = rc.check_against_oracle(x, NVFP4Quantizer(), label="inf")
  codes = rc.data_bits(qt.rowwise)
  assert codes[0, 0] == 0xF7 and codes[0, 1] == 0x88  # (+6, -6), (-0, -0)
  assert np.asarray(qt.rowwise.amax) == np.inf
  x[5, 6] = np.nan
  qt = rc.check_against_oracle(x, NVFP4Quantizer(), label="nan")
  assert np.all(rc.data_bits(qt.rowwise) == 0) and np.all(rc.scale_bits(qt.rowwise) == 0x7F)
  qt = rc.check_against_oracle(x, NVFP4Quantizer(per_token=True), label="nan per token")
  scales = rc.scale_bits(qt.rowwise)
  assert np.all(scales[5] == 0x7F) and not np.any(scales[6] == 0x7F)
  assert np.all(rc.data_bits(qt.rowwise)[5] == 0) and np.isnan(np.asarray(qt.rowwise.amax)[5])
  assert np.all(rc.scale_bits(qt.columnwise) == 0x7F)  # columnwise: per-tensor NaN


def test_nvfp4_tile_2d_usages_are_transposes():
  rng = np.random.default_rng(24)
  x = rc.random_input(rng, SQUARE, rc.DTYPES["bf16"])
  qt = rc.quantize_jit(jnp.asarray(x), NVFP4Quantizer(tile_2d=True), rc.USAGES)
  np.testing.assert_array_equal(rc.scale_bits(qt.columnwise), rc.scale_bits(qt.rowwise).T)
  unpack = lambda b: np.stack([b & 0xF, b >> 4], -1).reshape(b.shape[0], -1)
  np.testing.assert_array_equal(
    unpack(rc.data_bits(qt.columnwise)), unpack(rc.data_bits(qt.rowwise)).T
  )


def test_rht_extreme_blocks():
  """RHT blocks mixing huge and subnormal values, where a flushing backend loses addends:
  the sequential fp32 sum must be IEEE (e.g. 2^100 - 2^100 + 2^-130 = 2^-130)."""
  bf16 = rc.DTYPES["bf16"]
  rng = np.random.default_rng(25)
  for dtype in (bf16, np.float32):
    x = np.zeros(SQUARE, np.float32)
    xt = x.T  # columnwise stored = x.T: fill the blocks along M of xt
    tiny = float(ml_dtypes.finfo(dtype).smallest_subnormal)
    for r in range(128):
      big = np.float32(2.0 ** rng.integers(60, 127))
      blk = rng.integers(0, 2**7, 16).astype(np.float32) * np.float32(tiny)
      blk[:2] = big
      blk[rng.integers(2, 16)] = 0
      xt[r, 16 * (r % 8) : 16 * (r % 8) + 16] = blk * np.where(rng.random(16) < 0.3, -1, 1)
    rc.check_against_oracle(
      x.astype(dtype),
      NVFP4Quantizer(rht=True),
      ("columnwise",),
      label=f"rht extremes {np.dtype(dtype)}",
    )


def test_rht_sums_around_the_lifted_range():
  """The RHT's exact sums on a flushing backend: blocks of fp32 values around 2^-60 (below
  it both operands are summed lifted by 2^63), around 2^-126 and 2^-124 (subnormal partial
  sums and quarters), subnormals, huge values and values that cancel, against the oracle's
  IEEE sums (NaN payloads aside)."""
  rng = np.random.default_rng(28)
  rows = 512
  exps = [-149, -140, -130, -127, -126, -125, -124, -123, -62, -61, -60, -59, -40, 0, 100, 127]
  e = rng.choice(exps, (rows, 16)) + rng.integers(-2, 3, (rows, 16))
  with orc.errstate():  # exponents above 127 give infinities (and NaN sums): kept
    x = (rng.integers(1 << 23, 1 << 24, (rows, 16)) * np.exp2(e - 23.0)).astype(np.float32)
  sub = (rng.integers(1, 1 << 23, (rows, 16)) * 2.0**-149).astype(np.float32)
  x = np.where(rng.random((rows, 16)) < 0.25, sub, x)
  copies = np.take_along_axis(x, rng.integers(0, 16, (rows, 16)), axis=1)
  x = np.where(rng.random((rows, 16)) < 0.3, copies, x)
  x *= np.where(rng.random((rows, 16)) < 0.5, -1, 1).astype(np.float32)
  x = x.reshape(rows // 16, 256)
  for dtype in (np.float32, rc.DTYPES["bf16"]):
    if dtype is not np.float32:
      x = x.astype(dtype).astype(np.float32)
    got = jax.jit(rc.reference.apply_rht, static_argnums=1)(jnp.asarray(x), jnp.dtype(dtype))
    want = orc.rht(x, dtype)
    np.testing.assert_array_equal(rc.canon_f32_bits(got), rc.canon_f32_bits(want))


@pytest.mark.parametrize(
  "key",
  [jax.random.key(5), jax.random.PRNGKey(6), jax.random.key(7, impl="rbg")],
  ids=["threefry", "raw", "rbg"],
)
def test_stochastic_rounding_bits_are_jax_random_bits(key):
  """The fused threefry stream is jax.random.bits' (uint8), under vmap too."""
  for shape in ((128, 96), (3, 5, 16), (0, 16)):
    want = jax.random.bits(key, shape, jnp.uint8)
    got = jax.jit(nvfp4.random_bits, static_argnums=1)(key, shape)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  keys = jax.random.split(key, 3)
  want = jax.vmap(lambda k: jax.random.bits(k, (32, 16), jnp.uint8))(keys)
  got = jax.jit(jax.vmap(lambda k: nvfp4.random_bits(k, (32, 16))))(keys)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_stochastic_rounding_reproducible_and_key_dependent():
  rng = np.random.default_rng(26)
  x = jnp.asarray(rc.random_input(rng, SQUARE, rc.DTYPES["bf16"]))
  q = NVFP4Quantizer(rht=True, stochastic_rounding=True)
  a = rc.quantize_jit(x, q, rc.USAGES, key=KEY)
  b = rc.quantize_jit(x, q, rc.USAGES, key=KEY)
  c = rc.quantize_jit(x, q, rc.USAGES, key=jax.random.key(99))
  for u in rc.USAGES:
    np.testing.assert_array_equal(rc.data_bits(getattr(a, u)), rc.data_bits(getattr(b, u)))
    assert np.mean(rc.data_bits(getattr(a, u)) != rc.data_bits(getattr(c, u))) > 0.1


@jax.jit
def _sr_mean(x, keys):
  q = NVFP4Quantizer(stochastic_rounding=True)
  deq = jax.vmap(
    lambda k: rc.reference.dequantize(
      rc.reference.quantize(x, q, "rowwise", key=k), "rowwise", jnp.float32
    )
  )(keys)
  return jnp.mean(deq, axis=0)


def test_stochastic_rounding_is_unbiased():
  """The mean of N SR quantizations converges to x: per element within the 8-bit threshold
  bias (0.5/256 of a grid step) plus 6 standard errors (at most step / (2 sqrt N)); and its
  mean error is well below round-to-nearest's."""
  n = 512
  rng = np.random.default_rng(27)
  x = rng.uniform(-6, 6, (16, 64)).astype(np.float32)
  x[0, 0] = 6.0  # global amax 6, block amaxes 6: scales exactly 1, grid steps known
  x[:, ::16] = np.sign(x[:, ::16]) * 6
  mean = np.asarray(_sr_mean(jnp.asarray(x), jax.random.split(KEY, n)))
  rtn = np.asarray(
    rc.dequantize_jit(
      rc.quantize_jit(jnp.asarray(x), NVFP4Quantizer(), rc.USAGES), "rowwise", jnp.float32
    )
  )
  ax = np.abs(x)
  step = np.where(ax < 2, 0.5, np.where(ax < 4, 1.0, 2.0))
  bound = step * (0.5 / 256 + 6 * 0.5 / np.sqrt(n))
  assert np.all(np.abs(mean - x) <= bound), np.max(np.abs(mean - x) / bound)
  assert np.mean(np.abs(mean - x)) < 0.25 * np.mean(np.abs(rtn - x))
