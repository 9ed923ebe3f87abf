"""Random Hadamard transform for NVFP4 wgrad operands (NUMERICS.md, RHT).

Each run of 16 elements along the last dim is multiplied by R = diag(s) . H16 / 4. The
summation order is part of the contract, so kernels can match it bit for bit: for each
output j, acc = t_0, then acc = fl32(acc + t_i) for i = 1..15 in order, where
t_i = sign(s_i * H16[i, j]) * x_i (so an all -0 block sums to -0); then
y_j = fl32(acc * 0.25), rounded to the input dtype.

A flushing backend would drop subnormal addends and partial sums, so every add is
`fp32.add` (IEEE-exact on any backend; a power-of-two prescaling cannot cover blocks
that mix values near 2^100 with subnormals, whose partial sums may cancel to a tiny
value the subnormal addend then decides).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.reference import _fp32 as fp32

RHT_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.int32)


def hadamard16() -> np.ndarray:
  i = np.arange(16)
  parity = np.vectorize(lambda v: bin(v).count("1") & 1)(i[:, None] & i[None, :])
  return np.where(parity == 1, -1, 1).astype(np.int32)


def rht_signs() -> np.ndarray:
  """sign(R[i, j]) as a [16, 16] matrix of +-1."""
  return RHT_SIGNS[:, None] * hadamard16()


def apply_rht(x: jax.Array, input_dtype) -> jax.Array:
  """RHT along the last dim of an fp32 [rows, cols] matrix, cols % 16 == 0."""
  rows, cols = x.shape
  blocks = x.reshape(rows, cols // 16, 1, 16)
  signs = rht_signs()  # [i, j]
  # term i of every output j at once: [rows, blocks, 16 (j), 16 (i)], signs applied exactly.
  flip = jnp.asarray(signs.T < 0)
  terms = jnp.where(flip, fp32.neg(blocks), blocks)
  # A loop, not 15 unrolled exact adds: the body compiles once (XLA:CPU compile time
  # grows with the unrolled graph).
  terms = jnp.moveaxis(terms, -1, 0)
  acc = jax.lax.fori_loop(1, 16, lambda i, acc: fp32.add(acc, terms[i]), terms[0])
  y = fp32.mul(acc, jnp.float32(0.25))
  return fp32.round_to_dtype(y, input_dtype).reshape(rows, cols)
