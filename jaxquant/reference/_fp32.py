"""IEEE float32 arithmetic that stays exact where the backend flushes subnormals.

NUMERICS.md defines every step as IEEE fp32 with round-to-nearest-even. XLA's CPU
runtime flushes subnormal inputs and outputs of arithmetic to zero, so a plain `a * b`
differs from IEEE whenever a subnormal is involved (tiny amaxes, all-subnormal blocks,
E8M0 scales of 2^-127). The operations here take the hardware result where a cheap test
shows it is IEEE-exact and recompute the rest with integer arithmetic (decode the bits
into significand and exponent, compute exactly, round once with RNE): on the host for
the CPU backend (`host_fp32`), on the device for division on GPUs (`_div_exact`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxquant.reference import _host_fp32 as host_fp32

# uint32 constants: Python ints above 2^31 would not fit JAX's default int32.
_HALF_RANGE = np.uint32(0x80000000)
_ABS = np.uint32(0x7FFFFFFF)
_EXP = np.uint32(0x7F800000)
_QNAN = np.uint32(0x7FC00000)
_MIN_NORMAL = np.uint32(0x00800000)


def bits(x: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def from_bits(u: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(u.astype(jnp.uint32), jnp.float32)


def is_nan(x):
  return (bits(x) & _ABS) > _EXP


def is_zero(x):
  return (bits(x) & _ABS) == 0


def is_finite(x):
  return (bits(x) & _EXP) != _EXP


def abs_max(x: jax.Array, axis=None) -> jax.Array:
  """max |x| with NaN propagating, exact on subnormals (compares magnitude bits)."""
  return _from_magnitude(jnp.max(bits(x) & _ABS, axis=axis, initial=jnp.uint32(0)))


def abs_maximum(a: jax.Array, b: jax.Array) -> jax.Array:
  """Elementwise max(|a|, |b|), as `abs_max` of the two: an elementwise op, not a reduction,
  so that XLA fuses it with its neighbours instead of giving it a kernel of its own."""
  return _from_magnitude(jnp.maximum(bits(a) & _ABS, bits(b) & _ABS))


def _from_magnitude(mag):
  """The fp32 of magnitude bits, any NaN as the canonical quiet NaN."""
  return from_bits(jnp.where(mag > _EXP, jnp.uint32(_QNAN), mag))


def decompose(x):
  """fp32 -> (sign bit, significand in [2^23, 2^24) or 0, unbiased exponent of its MSB).

  Subnormals are normalised so the significand always has its leading bit at 23.
  """
  u = bits(x)
  sign = u >> 31
  field = ((u >> 23) & 0xFF).astype(jnp.int32)
  frac = u & np.uint32(0x7FFFFF)
  shift = jnp.where(field == 0, lax.clz(frac).astype(jnp.int32) - 8, 0)
  sig = jnp.where(field == 0, frac << jnp.clip(shift, 0, 31).astype(jnp.uint32), frac | _MIN_NORMAL)
  exp = jnp.where(field == 0, -126 - shift, field - 127)
  return sign, sig, exp


def _rne_shift_right(x, s):
  """round(x / 2^s) to nearest even, x uint32, s int32 >= 1 (any size)."""
  s_c = jnp.clip(s, 1, 31).astype(jnp.uint32)
  q = x >> s_c
  rem = x & ((jnp.uint32(1) << s_c) - 1)
  half = jnp.uint32(1) << (s_c - 1)
  up = (rem > half) | ((rem == half) & ((q & 1) == 1))
  small = q + up.astype(jnp.uint32)
  at_32 = (x > _HALF_RANGE).astype(jnp.uint32)  # x / 2^32 rounds to 1 only above one half
  return jnp.where(s <= 31, small, jnp.where(s == 32, at_32, jnp.uint32(0)))


def round_to_grid(mant, lsb_exp, emin: int, mbits: int):
  """Rounds the magnitude mant * 2^lsb_exp (mant > 0, uint32) to a float grid.

  The grid has `mbits` explicit mantissa bits and minimum normal exponent `emin`.
  Returns the magnitude code `(biased exponent << mbits) | mantissa` as uint32 (no
  overflow handling: callers saturate or map overflow to inf themselves).
  """
  msb = 31 - lax.clz(mant).astype(jnp.int32)
  e = msb + lsb_exp
  e_eff = jnp.maximum(e, emin)
  s = (e_eff - mbits) - lsb_exp
  n = jnp.where(s >= 1, _rne_shift_right(mant, s), mant << jnp.clip(-s, 0, 31).astype(jnp.uint32))
  return n + ((e_eff - emin).astype(jnp.uint32) << mbits)


def _pack_f32(sign, mag_code):
  mag = jnp.where(mag_code >= _EXP, jnp.uint32(_EXP), mag_code)  # overflow -> inf
  return from_bits((sign << 31) | mag)


def _significand_quotient(ma, mb):
  """(floor(ma * 2^26 / mb), whether a remainder is left) for significands ma < 2^24 and
  0 < mb < 2^24: long division in radix 2^8 on the hardware's exact integer division.
  Each partial remainder is below mb, so shifted by 8 bits it still fits in uint32; five
  divisions instead of 27 shift-and-subtract steps keep the division small in the HLO
  (a train step inlines it once per scalar scale it computes, and XLA's compile time
  grows with it)."""
  q, r = lax.div(ma, mb), lax.rem(ma, mb)
  for step in (8, 8, 8, 2):  # 26 quotient bits below the integer part
    shifted = r << np.uint32(step)
    q = (q << np.uint32(step)) | lax.div(shifted, mb)
    r = lax.rem(shifted, mb)
  return q, r != 0


@jax.jit
def _div_exact(a, b):
  sa, ma, ea = decompose(a)
  sb, mb, eb = decompose(b)
  sign = sa ^ sb
  q, inexact = _significand_quotient(ma, jnp.maximum(mb, 1))  # 26 or 27 significant bits
  mant = (q << 1) | inexact.astype(jnp.uint32)
  code = round_to_grid(mant, ea - eb - 27, -126, 23)
  res = _pack_f32(sign, code)
  a_zero, b_zero = ma == 0, mb == 0
  a_inf, b_inf = ~is_finite(a), ~is_finite(b)
  res = jnp.where(a_zero | b_inf, from_bits(sign << 31), res)
  res = jnp.where(a_inf | b_zero, from_bits((sign << 31) | _EXP), res)
  nan = is_nan(a) | is_nan(b) | (a_zero & b_zero) | (a_inf & b_inf)
  return jnp.where(nan, from_bits(jnp.uint32(_QNAN)), res)


def _is_tiny(x):
  """Subnormal or zero-adjacent: where a flushing backend may differ from IEEE."""
  mag = bits(x) & _ABS
  return (mag != 0) & (mag < _MIN_NORMAL)


def _hardware_ok(a, b, result, exact_zero=None):
  """The hardware result is IEEE-exact unless a subnormal came in or went out.

  A zero result from nonzero finite operands may be a flushed subnormal, unless
  `exact_zero` says the exact result is zero (a + b with b == -a).
  """
  nonzero_finite = ~is_zero(a) & ~is_zero(b) & is_finite(a) & is_finite(b)
  out_tiny = ((bits(result) & _ABS) < _MIN_NORMAL) & nonzero_finite
  if exact_zero is not None:
    out_tiny &= ~exact_zero
  return ~(_is_tiny(a) | _is_tiny(b) | out_tiny)


def _with_exact_fallback(host_exact, hw_result, a, b, exact_zero=None, device_exact=None):
  """The hardware result where it is IEEE-exact, an exact integer computation elsewhere.

  Only XLA's CPU runtime flushes subnormals (it sets FTZ/DAZ for every computation, with
  no flag to turn that off). There, elements that need it are recomputed by
  `host_exact` (numpy integers, `host_fp32`) in a host callback, only when some element
  needs it: inlined, an integer emulation at every call site multiplied the compile time
  of each quantize several times, for a path ordinary data never takes. Elsewhere the
  hardware result is IEEE, unless `device_exact` is given (XLA:GPU's fp32 division is
  the approximate div.full.f32), which then computes every element.
  """
  # Checks run on the operands as given (often a scalar or per-block scale) and broadcast
  # with the result; broadcasting a constant operand first would have XLA constant-fold
  # checks over the whole broadcast shape.
  ok = jnp.broadcast_to(_hardware_ok(a, b, hw_result, exact_zero), hw_result.shape)
  full = lambda v: jnp.broadcast_to(v, hw_result.shape)

  def patched():
    exact = jax.pure_callback(
      host_exact,
      jax.ShapeDtypeStruct(hw_result.shape, jnp.float32),
      full(a),
      full(b),
      vmap_method="broadcast_all",
    )
    return jnp.where(ok, hw_result, exact)

  cpu = lambda: lax.cond(jnp.all(ok), lambda: hw_result, patched)
  elsewhere = (
    (lambda: hw_result) if device_exact is None else (lambda: device_exact(full(a), full(b)))
  )
  return lax.platform_dependent(cpu=cpu, default=elsewhere)


# jit: traced once per operand shape and cached, as references call these many times.
@jax.jit
def mul(a, b):
  """fl32(a * b), IEEE round-to-nearest-even including subnormals."""
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return _with_exact_fallback(host_fp32.mul, a * b, a, b)


def add(a, b):
  """fl32(a + b), IEEE round-to-nearest-even including subnormals."""
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return _with_exact_fallback(
    host_fp32.add, a + b, a, b, exact_zero=(bits(a) ^ bits(b)) == _HALF_RANGE
  )


def neg(x):
  """-x by flipping the sign bit (exact for subnormals and zeros on any backend)."""
  return from_bits(bits(x) ^ _HALF_RANGE)


@jax.jit
def div(a, b):
  """fl32(a / b), IEEE round-to-nearest-even including subnormals."""
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return _with_exact_fallback(host_fp32.div, a / b, a, b, device_exact=_div_exact)


def _normalized(x):
  """(x * 2^k exactly, k) with k = 63 for subnormal x (making it normal), else k = 0.

  For subnormal x = f * 2^-149, setting the exponent field to 64 gives 2^-63 + f * 2^-86,
  and subtracting 2^-63 (exact, Sterbenz) leaves f * 2^-86 = x * 2^63.
  """
  u = bits(x)
  tiny = _is_tiny(x)
  lifted = from_bits((u & _ABS) | np.uint32(64 << 23)) - jnp.float32(2.0**-63)
  lifted = jnp.where((u >> 31) == 1, -lifted, lifted)
  return jnp.where(tiny, lifted, x), jnp.where(tiny, 63, 0)


def mul_for_encoding(x, s):
  """fl32(x * s) where it is at least the smallest normal; below that, a value of the
  right sign and magnitude below 2^-126 (possibly zero).

  For the product that is next rounded to an FP8 or E2M1 element: every such element's
  smallest nonzero magnitude is far above 2^-126, so products that small encode as a
  signed zero whatever their exact value. Subnormal operands are lifted into the normal
  range by an exact power of two first, so a flushing backend still multiplies them
  exactly; this costs a few operations instead of `mul`'s integer emulation.
  """
  x = jnp.asarray(x, jnp.float32)
  s = jnp.asarray(s, jnp.float32)
  xn, kx = _normalized(x)
  sn, ks = _normalized(s)
  p = xn * sn  # both normal: IEEE-rounded unless the exact product is below 2^-126
  k = kx + ks  # 0, 63 or 126; undo in steps of 2^-63 (a normal number)
  p = jnp.where(k >= 63, p * jnp.float32(2.0**-63), p)
  return jnp.where(k == 126, p * jnp.float32(2.0**-63), p)


def exp2(n):
  """2^n as fp32 for integer n in [-149, 127] (subnormal powers built from bits)."""
  n = jnp.asarray(n, jnp.int32)
  normal = (jnp.clip(n + 127, 1, 254).astype(jnp.uint32)) << 23
  sub = jnp.uint32(1) << jnp.clip(n + 149, 0, 22).astype(jnp.uint32)
  return from_bits(jnp.where(n >= -126, normal, sub))


_NARROW_FLOATS = {  # dtype -> (mantissa bits, min normal exponent, biased-exponent field width)
  jnp.dtype(jnp.bfloat16): (7, -126, 8),
  jnp.dtype(jnp.float16): (10, -14, 5),
}


def _narrow_subnormal(mant, emin: int, mbits: int):
  """The fp32 value mant * 2^(emin - mbits) of a narrow subnormal (mant < 2^mbits), exact
  without `mul`'s per-element checks (a host callback and a reduction over the whole
  array, against a constant XLA then tries to fold): where 2^(emin - mbits) is a normal
  fp32 (fp16), a product of normal numbers; else (bf16, fp32's top half) the fp32
  subnormal whose bits are mant shifted into place."""
  lsb = emin - mbits
  if lsb >= -126:
    return mant.astype(jnp.float32) * exp2(lsb)
  return from_bits(mant << (lsb + 149))


def widen(x: jax.Array) -> jax.Array:
  """A float32, bfloat16 or float16 array as float32, exactly, from its bit patterns.

  `x.astype(float32)` gives the same values, but XLA:GPU may merge that convert with the
  rounding to x's dtype in the op that produced x (its default xla_allow_excess_precision)
  and hand on values x never held: quantizing those is not quantizing x."""
  dtype = jnp.dtype(x.dtype)
  if dtype == jnp.float32:
    return x
  if dtype not in _NARROW_FLOATS:
    raise TypeError(f"widen: x must be float32, bfloat16 or float16, got {dtype}")
  code = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
  if dtype == jnp.bfloat16:
    return from_bits(code << 16)  # bf16 is fp32's top half
  mbits, emin, ebits = _NARROW_FLOATS[dtype]
  field = (code >> mbits) & jnp.uint32((1 << ebits) - 1)
  mant = code & jnp.uint32((1 << mbits) - 1)
  normal = ((field + jnp.uint32(emin + 127 - 1)) << 23) | (mant << (23 - mbits))
  subnormal = bits(_narrow_subnormal(mant, emin, mbits))
  special = _EXP | (mant << (23 - mbits))  # inf, or NaN with its payload
  magnitude = jnp.where(
    field == 0, subnormal, jnp.where(field == (1 << ebits) - 1, special, normal)
  )
  return from_bits(((code >> (mbits + ebits)) << 31) | magnitude)


def round_to_dtype(x: jax.Array, dtype) -> jax.Array:
  """fp32 -> bf16/fp16 value (returned as fp32), RNE with IEEE subnormals and overflow."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float32:
    return x.astype(jnp.float32)
  mbits, emin, ebits = _NARROW_FLOATS[dtype]
  sign, sig, exp = decompose(x)
  code = round_to_grid(jnp.maximum(sig, 1), exp - 23, emin, mbits)
  inf_code = jnp.uint32(((1 << ebits) - 1) << mbits)
  code = jnp.where(sig == 0, jnp.uint32(0), jnp.minimum(code, inf_code))
  # Re-express the narrow code as fp32 bits: same sign, exponent re-biased, mantissa widened.
  field = (code >> mbits).astype(jnp.int32)
  mant = code & jnp.uint32((1 << mbits) - 1)
  value = jnp.where(
    field == 0,
    _narrow_subnormal(mant, emin, mbits),
    from_bits(((field - 1 + emin + 127).astype(jnp.uint32) << 23) | (mant << (23 - mbits))),
  )
  value = jnp.where(field == (1 << ebits) - 1, jnp.float32(jnp.inf), value)
  value = jnp.where(sign == 1, -value, value)
  return jnp.where(is_nan(x) | (~is_finite(x)), x, value)
