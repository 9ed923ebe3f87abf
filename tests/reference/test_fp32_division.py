"""The GPU's exact fp32 division (`fp32._div_exact`, integer arithmetic only) bit for bit
against IEEE division as numpy performs it on this CPU (round to nearest even, subnormals
kept), over random bit patterns and the cases that need care. Integer operations are exact
on every backend, so the CPU runs the GPU's code path here. Likewise `fp32.abs_maximum`,
the magnitude max that delayed scaling folds amaxes with."""

import jax
import numpy as np

from jaxquant.reference import _fp32 as fp32

_SPECIAL = np.array(
  [
    0,
    1,
    2,
    3,
    0x00400000,
    0x007FFFFF,
    0x00800000,
    0x00800001,
    0x3F800000,
    0x3F800001,
    0x3F7FFFFF,
    0x3FFFFFFF,
    0x7F7FFFFF,
    0x7F800000,
    0x7FC00000,
    0x7F800001,
    0x45280000,
    0x0B2AAAAB,
  ],
  np.uint32,
)  # 0x45280000: 2688


def _operands(rng, n):
  a = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
  b = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
  sign = lambda k: rng.integers(0, 2, k).astype(np.uint32) << np.uint32(31)
  k = n // 8
  a[:k] = rng.choice(_SPECIAL, k) | sign(k)
  b[:k] = rng.choice(_SPECIAL, k) | sign(k)
  a[k : 2 * k] &= np.uint32(0x807FFFFF)  # subnormal dividends
  b[2 * k : 3 * k] &= np.uint32(0x807FFFFF)  # subnormal divisors
  # Quotients near 1 and near the subnormal and overflow thresholds.
  b[3 * k : 4 * k] = a[3 * k : 4 * k] + rng.integers(-2, 3, k).astype(np.uint32)
  b[4 * k : 5 * k] = (a[4 * k : 5 * k] & np.uint32(0x807FFFFF)) | np.uint32(0x7E000000)
  b[5 * k : 6 * k] = (a[5 * k : 6 * k] & np.uint32(0x807FFFFF)) | np.uint32(0x01000000)
  return a.view(np.float32), b.view(np.float32)


def test_device_division_is_ieee_bit_for_bit():
  a, b = _operands(np.random.default_rng(11), 1 << 18)
  got = np.asarray(jax.jit(fp32._div_exact)(a, b)).view(np.uint32)
  with np.errstate(all="ignore"):
    want = (a / b).view(np.uint32)
  nan = np.isnan(want.view(np.float32))
  assert np.all(got[nan] == 0x7FC00000), "NaN quotients are the canonical quiet NaN"
  mismatch = np.flatnonzero((got != want) & ~nan)
  assert mismatch.size == 0, [(a[i], b[i], hex(got[i]), hex(want[i])) for i in mismatch[:5]]


def test_abs_maximum_is_the_larger_magnitude_bit_for_bit():
  """Against numpy's max of magnitudes (no flushing on the host), NaN as the canonical quiet
  NaN: random bit patterns, subnormals and the special values, on the CPU, whose XLA
  flushes subnormal operands of float max (the reason abs_maximum compares bits)."""
  a, b = _operands(np.random.default_rng(12), 1 << 16)
  got = np.asarray(jax.jit(fp32.abs_maximum)(a, b)).view(np.uint32)
  with np.errstate(invalid="ignore"):
    want = np.fmax(np.abs(a), np.abs(b)).view(np.uint32)
  nan = np.isnan(a) | np.isnan(b)
  assert np.all(got[nan] == 0x7FC00000)
  mismatch = np.flatnonzero((got != want) & ~nan)
  assert mismatch.size == 0, [(a[i], b[i], hex(got[i]), hex(want[i])) for i in mismatch[:5]]
  assert np.count_nonzero((np.abs(a) < np.finfo(np.float32).tiny) & (a != 0)) > 1000
