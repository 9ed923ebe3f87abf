"""Shared test plumbing: jitted reference calls, bit extraction, numpy input builders, and
the dispatch from a quantizer spec to the numpy oracle (which never calls jaxquant).

One jitted `quantize` is shared by every test module so that a (quantizer, shape, dtype)
combination compiles once per run: compiling dominates the suite's time on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import numpy_oracle as orc

from jaxquant import reference
from jaxquant.quantizers import (
  BlockFloat8Quantizer,
  DelayedFloat8Quantizer,
  Float8Quantizer,
  MXFP8Quantizer,
  NVFP4Quantizer,
  for_usage,
)

DTYPES = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32}
USAGES = ("rowwise", "columnwise")

quantize_jit = jax.jit(reference.quantize, static_argnums=(1, 2))


@functools.partial(jax.jit, static_argnums=(1, 2))
def dequantize_jit(qt, usage, dtype):
  return reference.dequantize(qt, usage, dtype)


# ---------------------------------------------------------------- bits of a QuantizedData

_CANONICAL_NAN = np.uint32(0x7FC00000)


def canon_f32_bits(v) -> np.ndarray:
  v = np.asarray(v, np.float32)
  return np.where(np.isnan(v), _CANONICAL_NAN, orc.f32_bits(v))


def data_bits(qd) -> np.ndarray:
  return np.asarray(qd.data).view(np.uint8)


def scale_bits(qd) -> np.ndarray:
  s = np.asarray(qd.scale_inv)
  if s.dtype == np.float32:
    return canon_f32_bits(s)
  return s.view(np.uint8)


def assert_bits_equal(got, want, what):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape, f"{what}: shape {got.shape} != oracle {want.shape}"
  # 1-D at least: np.argwhere of a 0-d comparison is empty whatever its value.
  got, want = np.atleast_1d(got), np.atleast_1d(want)
  bad = np.argwhere(got != want)
  assert bad.size == 0, (
    f"{what}: {len(bad)} of {got.size} differ; first at {tuple(bad[0])}: "
    f"got {got[tuple(bad[0])]:#x}, oracle {want[tuple(bad[0])]:#x}"
  )


# ---------------------------------------------------------------- the oracle, per quantizer


def sr_bits(key, usage, stored_shape) -> np.ndarray:
  """The reference's documented random stream (randomness only; no jaxquant code)."""
  usage_key = jax.random.fold_in(key, 0 if usage == "rowwise" else 1)
  return np.asarray(jax.random.bits(usage_key, stored_shape, jnp.uint8))


def stored_matrix(x_np, usage) -> np.ndarray:
  x2d = orc.to_f32(x_np).reshape(-1, x_np.shape[-1])
  return x2d if usage == "rowwise" else x2d.T


def oracle_usage(x_np, q, usage, *, key=None, scale=None) -> dict:
  """The oracle's bits for one usage of x_np quantized with base quantizer q."""
  dtype = x_np.dtype
  stored = stored_matrix(x_np, usage)
  if isinstance(q, Float8Quantizer):
    s = orc.fp8_scale(orc.amax(stored), q.element, eps=q.eps, pow2=q.pow2_scales, input_dtype=dtype)
    return orc.fp8_with_scale(stored, s, q.element)
  if isinstance(q, DelayedFloat8Quantizer):
    return orc.fp8_with_scale(stored, scale, q.element)
  if isinstance(q, BlockFloat8Quantizer):
    block = (1, 128) if q.block == "1x128" else (128, 128)
    return orc.fp8_block(stored, q.element, block, eps=q.eps, pow2=q.pow2_scales, input_dtype=dtype)
  if isinstance(q, MXFP8Quantizer):
    return orc.mxfp8(stored, q.element)
  assert isinstance(q, NVFP4Quantizer)
  if q.rht and usage == "columnwise":
    stored = orc.rht(stored, dtype)
  bits = sr_bits(key, usage, stored.shape) if q.stochastic_rounding else None
  return orc.nvfp4(
    stored,
    (16, 16) if q.tile_2d else (1, 16),
    row_scaled=q.per_token and usage == "rowwise",
    random_bits=bits,
  )


def check_against_oracle(x_np, quantizer, usages=USAGES, *, key=None, state=None, label=""):
  """Quantizes x_np with the (jitted) reference and compares every bit with the oracle."""
  out = quantize_jit(jnp.asarray(x_np), quantizer, usages, key=key, state=state)
  qt = out[0] if state is not None else out
  for usage in usages:
    q = for_usage(quantizer, usage)
    what = f"{label} {quantizer} {usage} {x_np.dtype}{list(x_np.shape)}"
    if q is None:
      hp = np.ascontiguousarray(qt.usage(usage))
      want = np.asarray(x_np).reshape(-1, x_np.shape[-1])
      want = np.ascontiguousarray(want if usage == "rowwise" else want.T)
      assert hp.dtype == want.dtype, what
      assert_bits_equal(hp.view(np.uint8), want.view(np.uint8), what + " hp")
      continue
    qd = getattr(qt, usage)
    want = oracle_usage(
      x_np, q, usage, key=key, scale=None if state is None else np.asarray(state.scale)
    )
    assert_bits_equal(data_bits(qd), want["data"], what + " data")
    assert_bits_equal(scale_bits(qd), want["scale"], what + " scale")
    if "amax" in want:
      assert_bits_equal(
        canon_f32_bits(qd.amax), canon_f32_bits(want["amax"].view(np.float32)), what + " amax"
      )
  return out


# ---------------------------------------------------------------- inputs (numpy only)


def random_input(rng, shape, dtype) -> np.ndarray:
  """Gaussian values with a per-row and per-element spread of magnitudes."""
  rows = int(np.prod(shape[:-1]))
  x = rng.standard_normal((rows, shape[-1])).astype(np.float32)
  x *= np.exp2(rng.integers(-6, 7, (rows, 1))).astype(np.float32)
  x *= np.exp2(rng.integers(-3, 4, x.shape)).astype(np.float32)
  return x.reshape(shape).astype(dtype)


def subnormals(rng, shape, dtype) -> np.ndarray:
  """Every element a subnormal (or zero) of the input dtype, random signs."""
  fi = ml_dtypes.finfo(dtype)
  k = rng.integers(0, 2**fi.nmant, shape).astype(np.float64)
  sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)
  return (sign * k * float(fi.smallest_subnormal)).astype(dtype)


def grid(element) -> np.ndarray:
  """Non-negative finite values of an element type."""
  if element == "e2m1":
    return orc.E2M1_GRID.copy()
  vals = np.arange(256, dtype=np.uint8).view(orc.FP8_DTYPES[element]).astype(np.float32)
  return np.unique(vals[np.isfinite(vals) & (vals >= 0)])


def tie_pool(element) -> np.ndarray:
  """Grid values, exact midpoints (RNE ties) and their fp32 neighbours."""
  g = grid(element)
  mids = (g[:-1] + g[1:]) / np.float32(2)
  return np.concatenate(
    [g, mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(np.inf))]
  ).astype(np.float32)


def blocky_ties(rng, shape, dtype, element, block_cols, top, exps) -> np.ndarray:
  """Each run of `block_cols` elements along the last dim holds tie-pool values scaled by
  2^j (j drawn from `exps`) and one element of magnitude top * 2^j: with power-of-two
  scales the ties of the pool stay exact ties after scaling. Zeros, negative zeros and
  subnormals of the input dtype are mixed in."""
  rows, cols = int(np.prod(shape[:-1])), shape[-1]
  nb = cols // block_cols
  pool = tie_pool(element)
  x = rng.choice(pool, (rows, nb, block_cols))
  j = rng.choice(np.asarray(exps), (rows, nb, 1))
  x = x * np.exp2(j).astype(np.float32)
  np.put_along_axis(x, rng.integers(0, block_cols, (rows, nb, 1)), top * np.exp2(j), axis=2)
  x = np.where(rng.random(x.shape) < 0.5, -x, x).reshape(rows, cols)
  special = rng.random(x.shape)
  x = np.where(special < 0.03, 0.0, x)
  x = np.where((special >= 0.03) & (special < 0.06), -0.0, x)
  sub = subnormals(rng, x.shape, dtype).astype(np.float32)
  x = np.where((special >= 0.06) & (special < 0.09), sub, x)
  return x.reshape(shape).astype(dtype)


def safe_exps(dtype, top, lo=-4, hi=4):
  """Powers of two that keep top * 2^j finite in the input dtype."""
  jmax = int(np.floor(np.log2(float(orc.dtype_max(dtype)) / top)))
  return list(range(lo, min(hi, jmax) + 1))


def edge_suite(rng, shape, dtype, element, block_cols, top, exps=None, anchor=None) -> dict:
  """Named edge-case tensors of one shape and dtype (one compile serves all of them).

  `anchor`, if given, is written to the first element: it fixes the tensor's amax (NVFP4
  uses 2688 = 6 * 448, which makes S_enc exactly 1).
  """
  exps = safe_exps(dtype, top) if exps is None else exps
  base = blocky_ties(rng, shape, dtype, element, block_cols, top, exps)
  if anchor is not None:
    base.reshape(-1)[0] = anchor
  flat = base.reshape(-1).astype(np.float32)
  n = flat.size
  cases = {"ties": base}
  inf = flat.copy()
  pos = rng.choice(n, 6, replace=False)
  inf[pos[:2]] = [np.inf, -np.inf]
  big = float(orc.dtype_max(dtype))
  over = min(3 * top, big)
  inf[pos[2:]] = [over, -over, big, -big]  # saturate (per-tensor scale becomes 1)
  cases["inf"] = inf.reshape(shape).astype(dtype)
  nan = flat.copy()
  nan[rng.choice(n, 3, replace=False)] = [np.nan, -np.nan, np.inf]
  cases["nan"] = nan.reshape(shape).astype(dtype)
  zeros = np.where(rng.random(shape) < 0.5, -0.0, 0.0)
  cases["zeros"] = zeros.astype(dtype)
  cases["subnormal"] = subnormals(rng, shape, dtype)
  blocks = base.reshape(-1, shape[-1]).astype(np.float32).copy()
  rows = blocks.shape[0]
  blocks[rows // 4 : rows // 2, :block_cols] = 0.0  # all-zero blocks
  blocks[rows // 2 : 3 * rows // 4, :block_cols] = -0.0
  blocks[3 * rows // 4 :, :block_cols] = subnormals(
    rng, (rows - 3 * rows // 4, block_cols), dtype
  ).astype(np.float32)
  cases["zero_and_subnormal_blocks"] = blocks.reshape(shape).astype(dtype)
  cases["random"] = random_input(rng, shape, dtype)
  return cases
