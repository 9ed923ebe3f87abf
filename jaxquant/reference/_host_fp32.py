"""Exact IEEE fp32 mul, div and add in numpy integers, for the CPU host callback.

`fp32` sends the rare elements a flushing backend gets wrong here. The callback runs on
one of XLA's CPU threads, which have FTZ/DAZ set, so even numpy's float arithmetic
would flush; and calling back into JAX from it can deadlock against collectives of a
sharded program. Hence plain integer arithmetic: each operand is decoded into a
significand and exponent, the exact result is formed in uint64 / int64, and it is
rounded once to nearest even (subnormals included).
"""

from __future__ import annotations

import numpy as np

_ABS = np.uint32(0x7FFFFFFF)
_EXP = np.uint32(0x7F800000)
_QNAN = np.uint32(0x7FC00000)


def _bits(x) -> np.ndarray:
  # np.asarray keeps 0-d operands 0-d (ascontiguousarray would make them 1-d, and a
  # callback must return exactly the declared shape).
  return np.asarray(x, np.float32).view(np.uint32)


def _msb32(v: np.ndarray) -> np.ndarray:
  # Exact: a value below 2^32 converts to float64 without rounding and is normal.
  return np.frexp(v.astype(np.float64))[1].astype(np.int64) - 1


def _msb(v: np.ndarray) -> np.ndarray:
  """Index of the highest set bit of each nonzero uint64."""
  hi = v >> np.uint64(32)
  return np.where(hi > 0, 32 + _msb32(hi), _msb32(v & np.uint64(0xFFFFFFFF)))


def _decode(u: np.ndarray):
  """(sign, significand with its leading bit at 23 or 0, exponent of that bit)."""
  sign = (u >> 31).astype(np.uint32)
  field = ((u >> 23) & 0xFF).astype(np.int64)
  frac = (u & 0x7FFFFF).astype(np.uint64)
  sub = field == 0
  shift = np.where(sub & (frac > 0), 23 - _msb(np.maximum(frac, 1)), 0)
  sig = np.where(sub, frac << shift.astype(np.uint64), frac | np.uint64(1 << 23))
  exp = np.where(sub, -126 - shift, field - 127)
  return sign, sig, exp


def _round(sign, mag: np.ndarray, lsb_exp: np.ndarray) -> np.ndarray:
  """fp32 bits of (-1)^sign * mag * 2^lsb_exp, RNE, overflow to inf; mag < 2^63."""
  nonzero = mag > 0
  msb = _msb(np.maximum(mag, 1))
  e = np.maximum(msb + lsb_exp, -126)
  s = (e - 23) - lsb_exp  # low bits to drop (negative: exact, shift left)
  s_right = np.clip(s, 1, 63).astype(np.uint64)
  q = mag >> s_right
  rem = mag & ((np.uint64(1) << s_right) - np.uint64(1))
  half = np.uint64(1) << (s_right - np.uint64(1))
  q = q + ((rem > half) | ((rem == half) & ((q & np.uint64(1)) == 1))).astype(np.uint64)
  q = np.where(s >= 64, np.uint64(0), q)
  q = np.where(s <= 0, mag << np.clip(-s, 0, 63).astype(np.uint64), q)
  code = q + ((e + 126).astype(np.uint64) << np.uint64(23))
  code = np.where(code >= _EXP, np.uint64(_EXP), code)
  code = np.where(nonzero, code, np.uint64(0)).astype(np.uint32)
  return (sign.astype(np.uint32) << 31) | code


def _finish(result_bits, u_a, u_b, *, nan, inf, zero, sign):
  out = np.where(zero, sign << 31, result_bits)
  out = np.where(inf, (sign << 31) | _EXP, out)
  return np.where(nan, _QNAN, out).astype(np.uint32).view(np.float32)


def mul(a, b) -> np.ndarray:
  ua, ub = _bits(a), _bits(b)
  sa, ma, ea = _decode(ua)
  sb, mb, eb = _decode(ub)
  sign = sa ^ sb
  res = _round(sign, ma * mb, ea + eb - 46)
  a_inf, b_inf = (ua & _ABS) == _EXP, (ub & _ABS) == _EXP
  a_nan, b_nan = (ua & _ABS) > _EXP, (ub & _ABS) > _EXP
  zero = (ma == 0) | (mb == 0)
  inf = a_inf | b_inf
  return _finish(res, ua, ub, nan=a_nan | b_nan | (inf & zero), inf=inf, zero=zero, sign=sign)


def div(a, b) -> np.ndarray:
  ua, ub = _bits(a), _bits(b)
  sa, ma, ea = _decode(ua)
  sb, mb, eb = _decode(ub)
  sign = sa ^ sb
  num = ma << np.uint64(38)  # < 2^62; 38-39 quotient bits, the remainder is sticky
  q, r = np.divmod(num, np.maximum(mb, 1))
  res = _round(sign, (q << np.uint64(1)) | (r != 0).astype(np.uint64), ea - eb - 39)
  a_inf, b_inf = (ua & _ABS) == _EXP, (ub & _ABS) == _EXP
  a_nan, b_nan = (ua & _ABS) > _EXP, (ub & _ABS) > _EXP
  a_zero, b_zero = ma == 0, mb == 0
  return _finish(
    res,
    ua,
    ub,
    nan=a_nan | b_nan | (a_zero & b_zero) | (a_inf & b_inf),
    inf=(a_inf | b_zero) & ~a_nan & ~b_nan,
    zero=a_zero | b_inf,
    sign=sign,
  )


def add(a, b) -> np.ndarray:
  ua, ub = _bits(a), _bits(b)
  sa, ma, ea = _decode(ua)
  sb, mb, eb = _decode(ub)
  # Align on the larger exponent with 38 guard bits; an addend more than 38 binades
  # below only decides rounding, as a sticky unit of the right sign.
  big = np.maximum(np.where(ma > 0, ea, -1000), np.where(mb > 0, eb, -1000))

  def aligned(m, e, s):
    d = big - e
    exact = (m << np.uint64(38)) >> np.clip(d, 0, 63).astype(np.uint64)
    v = np.where(d <= 38, exact, (m > 0).astype(np.uint64)).astype(np.int64)
    return np.where(s == 1, -v, v)

  total = aligned(ma, ea, sa) + aligned(mb, eb, sb)
  sign = np.where(total < 0, 1, 0).astype(np.uint32)
  res = _round(sign, np.abs(total).astype(np.uint64), big - 23 - 38)
  a_inf, b_inf = (ua & _ABS) == _EXP, (ub & _ABS) == _EXP
  a_nan, b_nan = (ua & _ABS) > _EXP, (ub & _ABS) > _EXP
  # Exact zeros: (+0) + (+0) = +0, (-0) + (-0) = -0, otherwise +0 under RNE.
  zero_sign = (sa & sb).astype(np.uint32)
  inf_sign = np.where(a_inf, sa, sb).astype(np.uint32)
  out = np.where(total == 0, zero_sign << 31, res)
  out = np.where(a_inf | b_inf, (inf_sign << 31) | _EXP, out)
  nan = a_nan | b_nan | (a_inf & b_inf & (sa != sb))
  return np.where(nan, _QNAN, out).astype(np.uint32).view(np.float32)
