"""Random Hadamard transform for NVFP4 wgrad operands (NUMERICS.md, RHT).

Each run of 16 elements along the last dim is multiplied by R = diag(s) . H16 / 4. The
summation order is part of the contract, so kernels can match it bit for bit: for each
output j, acc = t_0, then acc = fl32(acc + t_i) for i = 1..15 in order, where
t_i = sign(s_i * H16[i, j]) * x_i (so an all -0 block sums to -0); then
y_j = fl32(acc * 0.25), rounded to the input dtype.

XLA's CPU runtime flushes subnormal operands and results to zero, so the sums and the
quarter are computed here so that no flushed value can change a result: where both
operands are below 2^-60, in a copy lifted by 2^63 (exact, subnormals included), where no
partial sum or product is subnormal. Above that, a hardware add is IEEE: an addend
below 2^-126 is under half an ulp of one of at least 2^-60, and two operands that cancel
to a result below 2^-126 are both multiples of 2^-84, so they cancel exactly. (A
per-block power-of-two prescaling cannot do this: a block may mix values near 2^100
with subnormals, whose partial sums may cancel to a tiny value a subnormal then decides.)
Every step is elementwise, so XLA fuses it: no host callback, no intermediate larger than
the input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.reference import _fp32 as fp32

RHT_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.int32)

_SIGN = np.uint32(0x80000000)
_ABS = np.uint32(0x7FFFFFFF)
_LIFT = 63  # operands below 2^-60 are summed times 2^63: at least 2^-86, at most 2^4
_SMALL = np.uint32(127 - 60 << 23)  # fp32 bits of 2^-60
_LIFTED_MIN_NORMAL = np.uint32(127 - 63 << 23)  # 2^-126 lifted: fp32 bits of 2^-63


def hadamard16() -> np.ndarray:
  i = np.arange(16)
  parity = np.vectorize(lambda v: bin(v).count("1") & 1)(i[:, None] & i[None, :])
  return np.where(parity == 1, -1, 1).astype(np.int32)


def rht_signs() -> np.ndarray:
  """sign(R[i, j]) as a [16, 16] matrix of +-1."""
  return RHT_SIGNS[:, None] * hadamard16()


def _magnitude(x):
  return fp32.bits(x) & _ABS


def _lift(x):
  """x * 2^63, exactly, for |x| < 2^-60 (subnormals included; other x: unused values).

  A subnormal f * 2^-149 with the exponent field set to 64 reads 2^-63 + f * 2^-86;
  subtracting 2^-63 (exact, Sterbenz) leaves f * 2^-86 = |x| * 2^63. A normal x times
  2^63 is a normal product, IEEE on any backend."""
  u = fp32.bits(x)
  mag = u & _ABS
  tiny = (mag != 0) & (mag < np.uint32(0x00800000))
  raised = fp32.from_bits(mag | np.uint32(_LIFT + 1 << 23)) - jnp.float32(2.0**-_LIFT)
  raised = fp32.from_bits(fp32.bits(raised) | (u & _SIGN))
  return jnp.where(tiny, raised, x * jnp.float32(2.0**_LIFT))


def _unlift(r):
  """fl32(r * 2^-63) as IEEE rounds it, for a lifted result r (normal or zero, |r| < 2^5).

  Below 2^-63 the result is subnormal: r * 2^86 counts its units of 2^-149, rounded to
  the nearest integer, ties to even (at 2^23 units it is 2^-126, whose bits those are)."""
  u = fp32.bits(r)
  mag = jnp.minimum(fp32.from_bits(u & _ABS), jnp.float32(2.0**-_LIFT))
  units = jax.lax.round(mag * jnp.float32(2.0**86), jax.lax.RoundingMethod.TO_NEAREST_EVEN)
  subnormal = fp32.from_bits((u & _SIGN) | units.astype(jnp.uint32))
  return jnp.where((u & _ABS) < _LIFTED_MIN_NORMAL, subnormal, r * jnp.float32(2.0**-_LIFT))


def _add(a, b):
  """fl32(a + b), IEEE on a flushing backend too (see the module docstring)."""
  small = jnp.maximum(_magnitude(a), _magnitude(b)) < _SMALL
  return jnp.where(small, _unlift(_lift(a) + _lift(b)), a + b)


def _quarter(x):
  """fl32(x * 0.25), IEEE on a flushing backend too: from 2^-60 up the product is normal."""
  return jnp.where(_magnitude(x) < _SMALL, _unlift(_lift(x) * jnp.float32(0.25)), x * 0.25)


def apply_rht(x: jax.Array, input_dtype) -> jax.Array:
  """RHT along the last dim of an fp32 [rows, cols] matrix, cols % 16 == 0."""
  rows, cols = x.shape
  blocks = x.reshape(rows, cols // 16, 16)
  flip = jnp.asarray(rht_signs() < 0)  # [i, j]: term i of output j is -x_i

  def term(i):
    """t_i of every output j of every block: x_i broadcast along the block, signs applied
    exactly. Only the running sums are as large as the input (all 16 terms of every
    output at once would be 16 times the input)."""
    x_i = jax.lax.dynamic_index_in_dim(blocks, i, axis=2)  # [rows, blocks, 1]
    return jnp.where(jax.lax.dynamic_index_in_dim(flip, i, axis=0), fp32.neg(x_i), x_i)

  # A loop, not 15 unrolled adds: the body compiles once (XLA:CPU compile time grows with
  # the unrolled graph).
  acc = jax.lax.fori_loop(1, 16, lambda i, acc: _add(acc, term(i)), term(0))
  return fp32.round_to_dtype(_quarter(acc), input_dtype).reshape(rows, cols)
