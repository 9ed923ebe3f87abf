"""An independent oracle for NUMERICS.md, in plain numpy float32 and ml_dtypes.

Nothing here imports jaxquant: every rule is re-derived from NUMERICS.md (and the
conventions the reference documents where NUMERICS.md is silent). numpy's float32
arithmetic is IEEE round-to-nearest-even with subnormals (no flushing), one operation
at a time, which is exactly NUMERICS.md's `fl32`. ml_dtypes conversions from float32
round to nearest even; after `np.clip` to +-fmax they implement `cvt_rne_satfinite`.

Every quantizer works on one usage's stored fp32 matrix `[rows, cols]`: the input
viewed as `[M, K]` for the rowwise usage, its transpose `[K, M]` for the columnwise one.
Results are integer bit patterns: `data` (uint8 codes; E2M1 packed two per byte) and
`scale` (uint32 for fp32 scales, uint8 for E8M0 / E4M3 scale bytes).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max
FMAX = {"e4m3": F32(448.0), "e5m2": F32(57344.0)}
FP8_DTYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
FP8_NAN_CODE = {"e4m3": 0x7F, "e5m2": 0x7E}  # canonical positive NaN (reference convention)
E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
RHT_S = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float32)


def errstate():
  return np.errstate(all="ignore")


def f32_bits(v) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(v, np.float32)).view(np.uint32)


def to_f32(x) -> np.ndarray:
  """Input (bf16 / fp16 / fp32) to fp32: exact."""
  return np.asarray(x).astype(np.float32)


def round_to_dtype(v: np.ndarray, dtype) -> np.ndarray:
  """fp32 -> dtype (RNE, IEEE subnormals) -> fp32."""
  return np.asarray(v, np.float32).astype(dtype).astype(np.float32)


def dtype_max(dtype) -> np.float32:
  return F32(ml_dtypes.finfo(dtype).max)


def amax(x: np.ndarray, axis=None) -> np.ndarray:
  """max |x| in fp32, NaN propagating; 0 for an empty set."""
  with errstate():
    return np.max(np.abs(x), axis=axis, initial=F32(0)).astype(np.float32)


def block_amax(x: np.ndarray, block) -> np.ndarray:
  """amax of every (br x bc) block tiling x from the top left; edge blocks may be partial
  (padding with zeros never raises an amax)."""
  rows, cols = x.shape
  br, bc = block
  nr, nc = -(-rows // br), -(-cols // bc)
  padded = np.zeros((nr * br, nc * bc), np.float32)
  padded[:rows, :cols] = x
  return amax(padded.reshape(nr, br, nc, bc), axis=(1, 3))


def expand(per_block: np.ndarray, block, shape) -> np.ndarray:
  br, bc = block
  return np.repeat(np.repeat(per_block, br, axis=0), bc, axis=1)[: shape[0], : shape[1]]


def fp8_codes(v: np.ndarray, element: str) -> np.ndarray:
  """cvt_rne_satfinite to FP8 as uint8 codes; NaN -> canonical positive NaN."""
  fmax = FMAX[element]
  with errstate():
    clipped = np.clip(np.asarray(v, np.float32), -fmax, fmax)
  codes = clipped.astype(FP8_DTYPES[element]).view(np.uint8)
  return np.where(np.isnan(v), np.uint8(FP8_NAN_CODE[element]), codes).astype(np.uint8)


def fp8_decode(codes: np.ndarray, element: str) -> np.ndarray:
  return np.asarray(codes, np.uint8).view(FP8_DTYPES[element]).astype(np.float32)


def e2m1_codes(v: np.ndarray) -> np.ndarray:
  """RNE satfinite to E2M1 codes (0..15); the sign bit is v's sign bit (-0 -> 8)."""
  with errstate():
    clipped = np.clip(np.asarray(v, np.float32), F32(-6), F32(6))
  codes = clipped.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & np.uint8(0xF)
  sign = (f32_bits(v) >> 31).astype(np.uint8)
  return ((codes & np.uint8(7)) | (sign << 3)).astype(np.uint8)


def pack_e2m1(codes: np.ndarray) -> np.ndarray:
  return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


# ---------------------------------------------------------------- per-tensor / block FP8


def fp8_scale(a, element: str, *, eps: float, pow2: bool, input_dtype) -> np.ndarray:
  """NUMERICS.md per-tensor FP8 steps 1-3, elementwise over amaxes `a`."""
  a = np.asarray(a, np.float32)
  eps32 = F32(eps)
  with errstate():
    a = np.where(a < eps32, eps32, a)
    scale = FMAX[element] / a
  scale = np.where(np.isinf(scale), dtype_max(input_dtype), scale).astype(np.float32)
  if pow2:
    scale = (f32_bits(scale) & np.uint32(0xFF800000)).view(np.float32)
  return np.where((a == 0) | ~np.isfinite(a), F32(1), scale).astype(np.float32)


def fp8_with_scale(x: np.ndarray, scale, element: str) -> dict:
  scale = np.asarray(scale, np.float32)
  with errstate():
    data = fp8_codes(x * scale, element)
    scale_inv = F32(1) / scale
  return dict(data=data, scale=f32_bits(scale_inv))


def fp8_tensor(x: np.ndarray, element: str, *, eps=0.0, pow2=False, input_dtype) -> dict:
  """Per-tensor current scaling of a stored matrix (its amax is the whole tensor's)."""
  scale = fp8_scale(amax(x), element, eps=eps, pow2=pow2, input_dtype=input_dtype)
  return fp8_with_scale(x, scale, element)


def fp8_block(x: np.ndarray, element: str, block, *, eps=0.0, pow2=True, input_dtype) -> dict:
  scale = fp8_scale(block_amax(x, block), element, eps=eps, pow2=pow2, input_dtype=input_dtype)
  with errstate():
    data = fp8_codes(x * expand(scale, block, x.shape), element)
    scale_inv = F32(1) / scale
  return dict(data=data, scale=f32_bits(scale_inv))


def delayed_update(hist: np.ndarray, scale, element: str, *, margin: int, algo: str):
  """NUMERICS.md delayed-scaling update with docs/numerics.md's rules (the history's max
  over its finite entries; the scale clamped into [2^-126, FLT_MAX], NaN as 1); hist[0]
  already holds this step's amax."""
  hist = np.asarray(hist, np.float32).copy()
  finite = np.where(np.isfinite(hist), np.abs(hist), F32(0))
  a = F32(np.max(finite, initial=F32(0))) if algo == "max" else hist[0]
  with errstate():
    new = (FMAX[element] / a) / F32(2.0**margin)
  if a == 0 or not np.isfinite(a):
    new = F32(scale)
  new = F32(1) if np.isnan(new) else min(max(F32(new), F32(2.0**-126)), FLT_MAX)
  hist = np.roll(hist, -1)
  hist[0] = 0
  return hist, F32(new)


# ---------------------------------------------------------------- MXFP8


def mxfp8(x: np.ndarray, element: str) -> dict:
  b = block_amax(x, (1, 32))
  with errstate():
    t = b * (F32(1) / FMAX[element])
  u = f32_bits(t)
  e_field, frac = (u >> 23) & 0xFF, u & 0x7FFFFF
  up = (frac > 0) & (e_field != 0xFE) & ~((e_field == 0) & (frac <= 0x400000))
  e = (e_field + up).astype(np.int64)
  e = np.where(t == 0, 0, e)
  e = np.where(np.isinf(t), 0xFE, e)
  e = np.where(np.isnan(t), 0xFF, e)
  mult = np.ldexp(F32(1), (127 - expand(e, (1, 32), x.shape)).astype(np.int32)).astype(np.float32)
  with errstate():
    data = fp8_codes(x * mult, element)
  return dict(data=data, scale=e.astype(np.uint8))


# ---------------------------------------------------------------- NVFP4


def hadamard16() -> np.ndarray:
  h = np.array([[1.0]], np.float32)
  for _ in range(4):  # Sylvester: H_2n = [[H, H], [H, -H]]
    h = np.block([[h, h], [h, -h]])
  return h


def rht(x: np.ndarray, input_dtype) -> np.ndarray:
  """R = diag(s) H16 / 4 on 16-blocks of the last dim: the signed terms t_i summed
  sequentially in fp32 starting from t_0 (so all -0 terms sum to -0), then * 0.25, then
  rounded to the input dtype."""
  rows, cols = x.shape
  blocks = x.reshape(rows, cols // 16, 16).astype(np.float32)
  signs = RHT_S[:, None] * hadamard16()
  out = np.empty_like(blocks)
  with errstate():
    for j in range(16):
      acc = blocks[..., 0] * signs[0, j]
      for i in range(1, 16):
        acc = acc + blocks[..., i] if signs[i, j] > 0 else acc - blocks[..., i]
      out[..., j] = acc * F32(0.25)
  return round_to_dtype(out.reshape(rows, cols), input_dtype)


def e2m1_stochastic_codes(y: np.ndarray, random_bits: np.ndarray) -> np.ndarray:
  """Round |y| up iff its fractional position between E2M1 neighbours > (u + 0.5) / 256."""
  with errstate():
    v = np.abs(y)
    lo_idx = np.clip(np.searchsorted(E2M1_GRID, v, side="right") - 1, 0, 6)
    lo, hi = E2M1_GRID[lo_idx], E2M1_GRID[lo_idx + 1]
    frac = (v - lo) / (hi - lo)
    threshold = (random_bits.astype(np.float32) + F32(0.5)) / F32(256)
  mag = lo_idx + (frac > threshold)
  mag = np.where(v >= 6, 7, mag).astype(np.uint8)
  return (mag | ((f32_bits(y) >> 31).astype(np.uint8) << 3)).astype(np.uint8)


def nvfp4(x: np.ndarray, block, *, row_scaled=False, random_bits=None) -> dict:
  """NVFP4 of a stored fp32 matrix (RHT, if any, already applied)."""
  rows, cols = x.shape
  g = amax(x, axis=1) if row_scaled else amax(x)
  with errstate():
    s_enc = np.minimum(F32(2688) / g, FLT_MAX)
    s_enc = np.where((g == 0) | (s_enc == 0), F32(1), s_enc).astype(np.float32)
    s_dec = (F32(1) / s_enc).astype(np.float32)
    s_enc_b = s_enc[:, None] if row_scaled else s_enc
    s_dec_b = s_dec[:, None] if row_scaled else s_dec
    b = block_amax(x, block)
    scale_codes = fp8_codes(b * (s_enc_b * (F32(1) / F32(6))), "e4m3")
    s = fp8_decode(scale_codes, "e4m3")
    enc = np.minimum(F32(1) / (s * s_dec_b), FLT_MAX)
    enc = np.where(s == 0, F32(0), enc).astype(np.float32)
    y = x * expand(enc, block, x.shape)
  codes = e2m1_codes(y) if random_bits is None else e2m1_stochastic_codes(y, random_bits)
  # A NaN global amax: every scale byte of its domain is the E4M3 NaN, every code 0.
  nan_rows = np.isnan(g) if row_scaled else np.full((rows,), bool(np.isnan(g)))
  codes = np.where(nan_rows[:, None], np.uint8(0), codes)
  nan_blocks = np.isnan(g)[:, None] if row_scaled else np.isnan(g)
  scale_codes = np.where(nan_blocks, np.uint8(0x7F), scale_codes).astype(np.uint8)
  return dict(
    data=pack_e2m1(codes), scale=scale_codes, amax=f32_bits(g), s_dec=s_dec, block_scale=s
  )
