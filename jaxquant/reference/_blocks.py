"""Reductions over scaling blocks of a stored matrix, and broadcasting scales back.

Blocks tile the stored `[rows, cols]` matrix from the top-left corner; a partial edge
block (block FP8 only) covers just the real elements, so padding uses zeros, which
never raise an amax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def block_reduce(x: jax.Array, block: tuple[int, int], reducer) -> jax.Array:
  """Applies `reducer(array, axis=(1, 3))` to every block; result [ceil(r/br), ceil(c/bc)]."""
  rows, cols = x.shape
  br, bc = block
  nr, nc = -(-rows // br), -(-cols // bc)
  padded = jnp.pad(x, ((0, nr * br - rows), (0, nc * bc - cols)))
  return reducer(padded.reshape(nr, br, nc, bc), axis=(1, 3))


def expand_blocks(scales: jax.Array, block: tuple[int, int], shape: tuple[int, int]) -> jax.Array:
  """Broadcasts one value per block back to every element of a [rows, cols] matrix."""
  br, bc = block
  # A static repeat count lowers to a broadcast and a reshape; passing total_repeat_length
  # instead makes jnp.repeat build index arrays with scatters and gathers: dozens of ops
  # per call for XLA to fuse, in every dequantization of a quantized train step.
  full = jnp.repeat(jnp.repeat(scales, br, axis=0), bc, axis=1)
  return full[: shape[0], : shape[1]]
