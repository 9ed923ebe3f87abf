"""Conversions between fp32 and the narrow element types, as integer codes.

`encode` is NUMERICS.md's `cvt_rne_satfinite`: round to nearest even, saturate finite
overflow (and inf) to the largest finite magnitude, keep NaN. It works on the fp32 bits,
so it is exact on every backend. NaN codes: E4M3 0x7F, E5M2 0x7E (canonical, positive);
E2M1 has no NaN and NVFP4 stores code 0 for NaN (NUMERICS.md, non-finite inputs).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxquant.reference import _fp32 as fp32


@dataclasses.dataclass(frozen=True)
class _Element:
  mbits: int
  emin: int  # exponent of the smallest normal value
  max_code: int  # magnitude code of the largest finite value
  nan_code: int


_ELEMENTS = {
  "e4m3": _Element(mbits=3, emin=-6, max_code=0x7E, nan_code=0x7F),
  "e5m2": _Element(mbits=2, emin=-14, max_code=0x7B, nan_code=0x7E),
  "e2m1": _Element(mbits=1, emin=0, max_code=0x7, nan_code=0x0),
}
_SIGN_SHIFT = {"e4m3": 7, "e5m2": 7, "e2m1": 3}
_ML_DTYPES = {
  "e4m3": ml_dtypes.float8_e4m3fn,
  "e5m2": ml_dtypes.float8_e5m2,
  "e2m1": ml_dtypes.float4_e2m1fn,
}


def _magnitude_code(x: jax.Array, element: str) -> jax.Array:
  """RNE magnitude code of |x| (finite, below saturation), as uint32."""
  el = _ELEMENTS[element]
  _, sig, exp = fp32.decompose(x)
  code = fp32.round_to_grid(jnp.maximum(sig, 1), exp - 23, el.emin, el.mbits)
  return jnp.where(sig == 0, jnp.uint32(0), code)


def encode(x: jax.Array, element: str) -> jax.Array:
  """fp32 -> element code (uint8), round to nearest even with finite saturation."""
  el = _ELEMENTS[element]
  x = x.astype(jnp.float32)
  sign = (fp32.bits(x) >> 31).astype(jnp.uint32)
  mag = jnp.minimum(_magnitude_code(x, element), jnp.uint32(el.max_code))
  code = (sign << _SIGN_SHIFT[element]) | mag
  nan = jnp.uint32(el.nan_code)
  return jnp.where(fp32.is_nan(x), nan, code).astype(jnp.uint8)


@functools.lru_cache(maxsize=None)
def _decode_table(element: str) -> np.ndarray:
  n = 1 << (_SIGN_SHIFT[element] + 1)
  return np.arange(n, dtype=np.uint8).view(_ML_DTYPES[element]).astype(np.float32)


def decode(code: jax.Array, element: str) -> jax.Array:
  """Element code (uint8) -> exact fp32 value."""
  return jnp.asarray(_decode_table(element))[code.astype(jnp.int32)]


def codes_to_dtype(code: jax.Array, element: str) -> jax.Array:
  """Reinterprets FP8 codes as JAX's float8 dtype (same bits)."""
  dtype = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}[element]
  return jax.lax.bitcast_convert_type(code.astype(jnp.uint8), dtype)


def dtype_to_codes(data: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(data, jnp.uint8)


def e2m1_neighbours(v: jax.Array):
  """For v >= 0 below saturation: the E2M1 magnitudes just below and above v."""
  lo_code = jnp.minimum(_truncated_code(v), jnp.uint32(6))
  table = jnp.asarray(_decode_table("e2m1")[:8])
  lo = table[lo_code.astype(jnp.int32)]
  hi = table[(lo_code + 1).astype(jnp.int32)]
  return lo_code, lo, hi


def _truncated_code(v):
  """Largest E2M1 magnitude code whose value is <= v (v >= 0, finite)."""
  table = jnp.asarray(_decode_table("e2m1")[:8])
  return jnp.sum((v[..., None] >= table[1:]).astype(jnp.uint32), axis=-1)


def pack_nibbles(codes: jax.Array) -> jax.Array:
  """[..., 2n] 4-bit codes -> [..., n] bytes, element 2j in the low nibble."""
  lo = codes[..., 0::2].astype(jnp.uint8)
  hi = codes[..., 1::2].astype(jnp.uint8)
  return lo | (hi << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
  lo = packed & 0xF
  hi = packed >> 4
  return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
