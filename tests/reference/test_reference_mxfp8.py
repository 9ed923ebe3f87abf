"""MXFP8 (E8M0 scale per 32, rounded up) against the numpy oracle."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpy_oracle as orc
import pytest
import ref_cases as rc

from jaxquant.quantizers import MXFP8Quantizer

SQUARE = (128, 128)
CASES = [
  (MXFP8Quantizer("e4m3"), "bf16"),
  (MXFP8Quantizer("e4m3"), "fp16"),
  (MXFP8Quantizer("e4m3"), "fp32"),
  (MXFP8Quantizer("e5m2"), "bf16"),
  (MXFP8Quantizer("e5m2"), "fp32"),
]


@pytest.mark.parametrize("q,dt", CASES, ids=lambda v: str(v))
def test_mxfp8_edge_cases(q, dt):
  rng = np.random.default_rng(11)
  dtype = rc.DTYPES[dt]
  top = float(orc.FMAX[q.element])
  exps = rc.safe_exps(dtype, top, lo=-12, hi=12)
  for name, x in rc.edge_suite(rng, SQUARE, dtype, q.element, 32, top, exps).items():
    rc.check_against_oracle(x, q, label=name)
    rc.check_against_oracle(np.ascontiguousarray(x.T), q, label=name + ".T")


@pytest.mark.parametrize(
  "shape,usages",
  [
    ((32, 256), rc.USAGES),
    ((3, 5, 64), ("rowwise",)),
    ((0, 64), rc.USAGES),
    ((128, 384), rc.USAGES),
  ],
)
def test_mxfp8_shapes(shape, usages):
  rng = np.random.default_rng(12)
  rc.check_against_oracle(rc.random_input(rng, shape, rc.DTYPES["bf16"]), MXFP8Quantizer(), usages)


def _amax_for_t(t_bits: int, fmax) -> list:
  """Block amaxes b (3 fp32 steps either side of t / fl32(1/fmax)) whose
  t = fl32(b * fl32(1/fmax)) hits the fp32 pattern t_bits or its neighbours."""
  with np.errstate(all="ignore"):
    b = np.uint32(t_bits).view(np.float32) / (np.float32(1) / fmax)
  out, up, down = [b], b, b
  for _ in range(3):
    up, down = np.nextafter(up, np.float32(np.inf)), np.nextafter(down, np.float32(0))
    out += [up, down]
  return out


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
def test_mxfp8_scale_rounding_rule(element):
  """The round-up E8M0 rule on its corner cases: t subnormal with F <= 0x400000 (kept at
  E = 0) or above (rounded to E = 1), t in (2^-127, 2^-126), exact powers of two (kept),
  E = 0xFD (rounded up to 0xFE), t = 0 (e = 0), inf block (0xFE), NaN block (0xFF)."""
  fmax = orc.FMAX[element]
  amaxes = []
  for t_bits in (
    0x00000001,
    0x00200000,
    0x003FFFFF,
    0x00400000,
    0x00400001,
    0x007FFFFF,
    0x00800000,
    0x00800001,
    0x3F800000,
    0x3F800001,
    0x7E800000,
    0x7E800001,
  ):
    amaxes += _amax_for_t(t_bits, fmax)
  amaxes = [a for a in amaxes if np.isfinite(a)]
  amaxes += [
    np.float32(0),
    np.float32(np.inf),
    np.float32(np.nan),
    np.finfo(np.float32).max,
    np.float32(2.0**-149),
    np.float32(fmax),
  ]
  rng = np.random.default_rng(13)
  x = np.zeros((128, 128), np.float32)
  flat_blocks = x.reshape(-1, 32)
  for i, a in enumerate(amaxes):
    blk = flat_blocks[i]
    blk[:] = (rng.random(32).astype(np.float32) * a) if np.isfinite(a) and a > 0 else 0
    blk[rng.integers(32)] = -a if i % 2 else a
    blk[-1] = -0.0
  x = flat_blocks.reshape(128, 128)
  qt = rc.check_against_oracle(x, MXFP8Quantizer(element), label="rule")
  e = rc.scale_bits(qt.rowwise).reshape(-1)
  want_special = {len(amaxes) - 6: 0, len(amaxes) - 5: 0xFE, len(amaxes) - 4: 0xFF}
  for i, want in want_special.items():
    assert e[i] == want, (i, amaxes[i], e[i])
  # Hand-checked anchors: t exactly 1 keeps e = 127; t = 2^-149 (F = 1 <= 0x400000) gives 0.
  rc.check_against_oracle(np.ascontiguousarray(x.T), MXFP8Quantizer(element), label="rule.T")


def test_mxfp8_subnormal_t_window():
  """Block amaxes whose t = b / fmax lands in (2^-127, 2^-126), densely."""
  rng = np.random.default_rng(14)
  x = np.zeros((128, 128), np.float32)
  lo, hi = np.log2(448.0) - 128, np.log2(448.0) - 125.5
  b = np.exp2(rng.uniform(lo, hi, (128, 4))).astype(np.float32)
  blocks = x.reshape(128, 4, 32)
  blocks[:] = rng.uniform(-1, 1, blocks.shape).astype(np.float32) * b[..., None]
  blocks[..., 0] = b
  rc.check_against_oracle(x, MXFP8Quantizer("e4m3"), label="t window")
  e = rc.scale_bits(rc.quantize_jit(jnp.asarray(x), MXFP8Quantizer("e4m3"), rc.USAGES).rowwise)
  assert set(np.unique(e)) >= {0, 1, 2}, np.unique(e)


def test_mxfp8_nan_inf_blocks():
  x = np.ones((128, 128), np.float32)
  x[0, 3], x[1, 40], x[2, 0] = np.nan, -np.inf, np.inf
  qt = rc.quantize_jit(jnp.asarray(x), MXFP8Quantizer("e4m3"), rc.USAGES)
  e, d = rc.scale_bits(qt.rowwise), rc.data_bits(qt.rowwise)
  assert e[0, 0] == 0xFF and e[1, 1] == 0xFE and e[2, 0] == 0xFE and e[3, 0] == 127 - 8
  assert d[0, 3] == 0x7F and d[1, 40] == 0xFE and d[2, 0] == 0x7E
