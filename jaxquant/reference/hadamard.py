"""Random Hadamard transform for NVFP4 wgrad operands (NUMERICS.md, RHT).

Each run of 16 elements along the last dim is multiplied by R = diag(s) . H16 / 4. The
summation order is part of the contract, so kernels can match it bit for bit: for each
output j, acc = sum over i = 0..15, in order, of sign(s_i * H16[i, j]) * x_i in fp32;
then y_j = fl32(acc * 0.25), rounded to the input dtype.

A flushing backend would drop subnormal addends, so each 16-block is first scaled by a
power of two 2^p that brings its largest magnitude near 2^100 (p in [0, 126]): every
addend and partial sum is then a normal number and each add rounds exactly as IEEE adds
on the unscaled values would, and the single scaling back rounds once. (Blocks whose
largest magnitude exceeds 2^77 may still lose subnormal addends on such a backend; no
finite input of bf16 or fp16 origin reaches this case with a subnormal partner that
survives the sum's rounding.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.reference import fp32

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
  blocks = x.reshape(rows, cols // 16, 16)
  block_max = fp32.abs_max(blocks, axis=-1)[..., None]
  _, _, max_exp = fp32.decompose(block_max)
  p = jnp.clip(100 - max_exp, 0, 126)
  scaled = fp32.mul(blocks, fp32.exp2(p))
  signs = rht_signs()
  outputs = []
  for j in range(16):
    acc = jnp.zeros(blocks.shape[:-1], jnp.float32)
    for i in range(16):
      term = scaled[..., i]
      acc = acc + term if signs[i, j] > 0 else acc - term
    outputs.append(acc * jnp.float32(0.25))
  y = fp32.mul(jnp.stack(outputs, axis=-1), fp32.exp2(-p))
  return fp32.round_to_dtype(y, input_dtype).reshape(rows, cols)
