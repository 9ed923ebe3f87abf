"""NVFP4: E2M1 data, E4M3 block scales, fp32 global amax (NUMERICS.md, NVFP4)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.formats import Format
from jaxquant.reference import _elements as elements
from jaxquant.reference import _fp32 as fp32
from jaxquant.reference._blocks import block_reduce
from jaxquant.tensor import QuantizedData

_FLT_MAX = np.float32(np.finfo(np.float32).max)  # numpy: importing must not start a backend
_ONE_SIXTH = np.float32(1.0) / np.float32(6.0)


def global_scales(amax: jax.Array):
  """(S_enc, S_dec) from a global amax (scalar or per row)."""
  s_enc = jnp.minimum(fp32.div(jnp.float32(2688.0), amax), _FLT_MAX)
  s_enc = jnp.where(fp32.is_zero(amax) | fp32.is_zero(s_enc), jnp.float32(1.0), s_enc)
  return s_enc, fp32.div(jnp.float32(1.0), s_enc)


def _by_block(x: jax.Array, block: tuple[int, int]) -> jax.Array:
  """A [rows, cols] matrix as [rows / br, br, cols / bc, bc]: one value per block then
  broadcasts over its elements, with no block-expanded copy of the scales for XLA to
  build (NVFP4 blocks tile the matrix exactly)."""
  rows, cols = x.shape
  br, bc = block
  return x.reshape(rows // br, br, cols // bc, bc)


def _per_block(v: jax.Array) -> jax.Array:
  """One value per block, [rows / br, cols / bc], against `_by_block`'s layout."""
  return v[:, None, :, None]


def _block_abs_max(blocks: jax.Array, axis) -> jax.Array:
  """`fp32.abs_max` of every block, a reduction XLA never evaluates at compile time.

  A constant matrix (the output gradient of a loss that sums the output is all ones) would
  have XLA fold this reduction element by element while it compiles: seconds for a large
  one. The reduction's initial value comes through an optimization barrier, so one of its
  operands is never constant.
  """
  magnitudes = fp32.bits(blocks) & np.uint32(0x7FFFFFFF)
  start = jax.lax.optimization_barrier(np.uint32(0))
  block_max = jax.lax.reduce(magnitudes, start, jax.lax.max, tuple(axis))
  return fp32.abs_max(fp32.from_bits(block_max), axis=())  # NaNs as abs_max gives them


def _per_row(v, rows):
  """A scalar or [rows] vector as a [rows, 1] column for broadcasting over blocks."""
  return jnp.broadcast_to(jnp.reshape(v, (-1, 1)), (rows, 1)) if v.ndim else v


_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def random_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """The stochastic-rounding bits of a usage: `jax.random.bits(key, shape, jnp.uint8)`, bit
  for bit.

  JAX's threefry runs on the CPU as a loop over operand-sized arrays: four uint32 words per
  element (16 bytes) live at once, more than the rest of a quantized train step takes.
  Written out here, its 20 rounds are elementwise and XLA fuses them with the counters and
  the byte conversion: only the bytes are stored. This is JAX's partitionable threefry
  stream (the default): counter i is the element's row-major index, the bits the low byte
  of the two output words' xor. Another PRNG implementation, the other stream, or more
  than 2^32 elements take `jax.random.bits` itself.
  """
  typed = key if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(key)
  if (
    str(jax.random.key_impl(typed)) != "threefry2x32"
    or not jax.config.jax_threefry_partitionable
    or math.prod(shape) >= 2**32
  ):
    return jax.random.bits(key, shape, jnp.uint8)
  words = jax.random.key_data(typed)
  ks = (words[0], words[1], words[0] ^ words[1] ^ np.uint32(0x1BD11BDA))
  x0 = jnp.full(shape, ks[0], jnp.uint32)  # the counters' high words are 0
  x1 = jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape) + ks[1]
  for i in range(5):
    for r in _THREEFRY_ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = ((x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r))) ^ x0
    x0 = x0 + ks[(i + 1) % 3]
    x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
  return (x0 ^ x1).astype(jnp.uint8)


def _encode_stochastic(y: jax.Array, random_bits: jax.Array) -> jax.Array:
  """E2M1 code of y, rounding up with probability equal to y's position between grid points."""
  v = jnp.abs(y)
  lo_code, lo, hi = elements.e2m1_neighbours(v)
  # Exact: v - lo is Sterbenz-exact and hi - lo a power of two, so multiplying by its
  # reciprocal is exact too (a hardware division need not be: XLA:GPU's is approximate).
  frac = (v - lo) * (1.0 / (hi - lo))
  threshold = (random_bits.astype(jnp.float32) + 0.5) * jnp.float32(1.0 / 256.0)
  mag = lo_code + (frac > threshold).astype(jnp.uint32)
  mag = jnp.where(v >= 6.0, jnp.uint32(7), mag)
  sign = fp32.bits(y) >> 31
  return jnp.where(fp32.is_nan(y), jnp.uint32(0), (sign << 3) | mag).astype(jnp.uint8)


def quantize(x: jax.Array, fmt: Format, *, random_bits=None, amax=None) -> QuantizedData:
  """Quantizes a stored [rows, cols] fp32 matrix (RHT, if any, already applied).

  `amax`: the global amax (scalar, or [rows] when row-scaled) when the caller already has
  it, e.g. reduced across shards; by default this matrix's own.
  """
  rows, _ = x.shape
  block_amax = block_reduce(x, fmt.block, _block_abs_max)
  if amax is None:
    # The max of the block amaxes, the same bits: XLA fuses that reduction with its input,
    # where it splits one over the whole matrix around a copy of it.
    amax = fp32.abs_max(block_amax, axis=1) if fmt.row_scaled else fp32.abs_max(block_amax)
  s_enc, s_dec = global_scales(amax)
  if fmt.row_scaled:  # 1-D blocks: block rows are the tensor rows
    s_enc_b, s_dec_b = _per_row(s_enc, rows), _per_row(s_dec, rows)
  else:
    s_enc_b, s_dec_b = s_enc, s_dec
  scale_codes = elements.encode(
    fp32.mul(block_amax, s_enc_b * jnp.float32(_ONE_SIXTH)), "e4m3"
  )  # S_enc / 6 is normal
  s = elements.decode(scale_codes, "e4m3")
  enc = jnp.minimum(fp32.div(jnp.float32(1.0), fp32.mul(s, s_dec_b)), _FLT_MAX)
  enc = jnp.where(s == 0, jnp.float32(0.0), enc)
  y = fp32.mul_for_encoding(_by_block(x, fmt.block), _per_block(enc)).reshape(x.shape)
  if random_bits is None:
    codes = elements.encode(y, "e2m1")
  else:
    codes = _encode_stochastic(y, random_bits)
  scale = jax.lax.bitcast_convert_type(scale_codes, jnp.float8_e4m3fn)
  return QuantizedData(elements.pack_nibbles(codes), scale, amax, fmt)


def dequantize_values(qd: QuantizedData) -> jax.Array:
  """q * s for each element: the block-scaled values, global decode scale left out."""
  codes = elements.unpack_nibbles(qd.data)
  values = elements.decode(codes, "e2m1")
  s = elements.decode(jax.lax.bitcast_convert_type(qd.scale_inv, jnp.uint8), "e4m3")
  # A plain product is IEEE here on any backend: an E2M1 value (0 or 0.5 to 6) times an
  # E4M3 one (2^-9 to 448, or NaN) is exact in fp32 and never subnormal, so no flushing
  # backend can change it and `fp32.mul`'s check of every element is not needed.
  block_values = _by_block(values, qd.format.block) * _per_block(s)
  return block_values.reshape(values.shape)


def decode_scale(qd: QuantizedData) -> jax.Array:
  """S_dec: a scalar, or [rows] for per-token data."""
  return global_scales(qd.amax)[1]
