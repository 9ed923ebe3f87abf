"""One-byte codes transposed, [R, C] -> [C, R], by a kernel.

Per-tensor FP8 scales a whole tensor by one scale, so its columnwise codes are its rowwise
codes transposed. Where the rowwise codes already exist (gathered over the network, or
written by the op that made the tensor) this kernel makes the columnwise ones from them:
1 byte read and 1 written per code, where a cast of both usages reads the tensor's 2-byte
values again. XLA's own transpose of one-byte elements is much slower (benchmarks.md,
"Where quantization runs"). Each device transposes its shard: the result is sharded as the
input, its dims swapped.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.core import ShapedArray

from jaxquant.kernels import _primitive as primitive
from jaxquant.kernels import _sharding as sharding

# The kernel moves 16-byte vectors: both dims whole multiples of them, on every shard.
ALIGNMENT = 16


@dataclasses.dataclass(frozen=True)
class TransposeConfig:
  """No options: the kernel's one form (primitives take a hashable config)."""

  def ffi_attributes(self) -> dict:
    return {}


def _abstract_eval(codes, *, config):
  rows, cols = codes.shape
  return [ShapedArray((cols, rows), codes.dtype)]


def _reference(codes, *, config):
  return [codes.T]


def _partition(config, mesh, arg_shapes, result_shape):
  rows, cols = arg_shapes[0].shape
  row_axes, col_axes = sharding.spec_axes(arg_shapes[0].sharding, 2)
  row_axes = sharding.keep_if_whole(mesh, row_axes, rows, ALIGNMENT)
  col_axes = sharding.keep_if_whole(mesh, col_axes, cols, ALIGNMENT)
  return (
    [sharding.pspec(row_axes, col_axes)],
    [sharding.pspec(col_axes, row_axes)],
    lambda kernel, shard: kernel(shard),
  )


def _sharding_rule(config, shapes, mesh_size):
  return sharding.rule([("r", "c")], [("c", "r")], {})


SPEC = primitive.KernelSpec(
  name="jaxquant_transpose_codes",
  abstract_eval=_abstract_eval,
  reference=_reference,
  partition=_partition,
  sharding_rule=_sharding_rule,
)
transpose_codes_p = primitive.define(SPEC)


def transpose_reason(codes) -> str | None:
  """Why the kernel does not take `codes`, or None: a [R, C] matrix of one-byte elements,
  R and C multiples of 16."""
  if jnp.ndim(codes) != 2:
    return f"expects a [R, C] matrix, got shape {tuple(jnp.shape(codes))}"
  if jnp.dtype(codes.dtype).itemsize != 1:
    return f"expects one-byte codes, got {jnp.dtype(codes.dtype).name}"
  rows, cols = codes.shape
  if rows % ALIGNMENT or cols % ALIGNMENT:
    return f"R = {rows} and C = {cols} must be multiples of {ALIGNMENT}"
  return None


def transpose_codes(codes: jax.Array) -> jax.Array:
  """`codes.T` of one-byte codes [R, C] (FP8 or uint8), R and C multiples of 16."""
  reason = transpose_reason(codes)
  if reason:
    raise ValueError(f"transpose_codes: {reason}")
  return transpose_codes_p.bind(codes, config=TransposeConfig())[0]
