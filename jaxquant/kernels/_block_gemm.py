"""Block-scaled FP8 GEMM kernel: D = A . B^T for DeepSeek-style block FP8 operands.

A [M, K] E4M3 with 1x128 blocks, B [N, K] E4M3 with 128x128 tiles (fprop, dgrad) or 1x128
blocks (wgrad); both in their stored layout, as `ops.gemm` passes them. The scales travel
MN-major, `[ceil(K / 128), M]` and `[ceil(K / 128), N / b_block_rows]`: the layout of
CUTLASS's Hopper blockwise mainloop (ffi/gemm/block_fp8_gemm.cuh), which sums each 128-deep
k-tile on FP8 tensor cores and adds it, scaled, into an fp32 accumulator. The handler
first offers the problem to cuBLASLt's block-scaled FP8 GEMM (faster on the H100; the same
fp32 accumulation of scaled 128-deep partial sums) and keeps CUTLASS for what cuBLASLt
does not take (no algorithm for the problem). Elsewhere the
lowering is the reference: dequantize both operands, one fp32 dot. Under a sharded jit,
A's rows (tokens) and B's rows (output features) stay on their devices when every shard
holds whole blocks, and so does a K split alike in both into whole blocks (`_partition`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jaxquant.kernels import _primitive as primitive
from jaxquant.kernels import _sharding as sharding
from jaxquant.kernels import _validate as validate

BLOCK = 128


@dataclasses.dataclass(frozen=True)
class BlockGemmConfig:
  b_block_rows: int  # 1 (1x128 blocks) or 128 (128x128 tiles)
  out_dtype: str

  def ffi_attributes(self) -> dict:
    return {"b_block_rows": np.int32(self.b_block_rows)}


def _abstract_eval(a, b, sfa, sfb, *, config):
  return [ShapedArray((a.shape[0], b.shape[0]), jnp.dtype(config.out_dtype))]


def _expand(scales_mn_major, rows: int, block_rows: int, k: int):
  """[KB, rows / block_rows] scales -> [rows, K] multipliers."""
  per_row = jnp.repeat(scales_mn_major.T, block_rows, axis=0)[:rows]
  return jnp.repeat(per_row, BLOCK, axis=1)[:, :k]


def _reference(a, b, sfa, sfb, *, config):
  (m, k), n = a.shape, b.shape[0]
  va = a.astype(jnp.float32) * _expand(sfa, m, 1, k)
  vb = b.astype(jnp.float32) * _expand(sfb, n, config.b_block_rows, k)
  out = jax.lax.dot_general(
    va,
    vb,
    (((1,), (1,)), ((), ())),
    precision=jax.lax.Precision.HIGHEST,
    preferred_element_type=jnp.float32,
  )
  return [out.astype(config.out_dtype)]


# Rows per shard, for A's rows (M) and B's rows (N) to stay sharded: the kernel reads the
# scales MN-major through TMA, whose rows must be 16-byte aligned, and the output rows too.
_ROWS_PER_SHARD = 16


def _sharding_rule(config, shapes, mesh_size):
  """A's rows (M) and B's rows (N) may be sharded, and K in whole 128-deep blocks, split
  alike in both operands and their scales' k-blocks (a reduction): each k-block's scales
  multiply one whole 128-deep partial sum."""
  (_, k), (n, _) = shapes[0], shapes[1]
  replicated = ()
  sizes = {}
  if k % BLOCK == 0:
    k_dim = ("kb", "ki")
    sizes.update(kb=k // BLOCK, ki=BLOCK)
    replicated += ("ki",)
  else:  # a partial last block: K stays whole
    k_dim = "k"
    replicated += ("k", "kb")
  if config.b_block_rows == 1:
    n_dim, b_scale_rows = "n", "n"
  elif n % BLOCK == 0:  # 128x128 tiles: N = (tiles, rows in a tile)
    n_dim, b_scale_rows = ("nb", "ni"), "nb"
    sizes.update(nb=n // BLOCK, ni=BLOCK)
  else:  # a partial last tile: B and its scales stay whole
    n_dim, b_scale_rows = "n", "nb"
    replicated += ("n", "nb")
  operands = [("m", k_dim), (n_dim, k_dim), ("kb", "m"), ("kb", b_scale_rows)]
  reduced = ("kb",) if k % BLOCK == 0 else ()
  return sharding.rule(
    operands, [("m", n_dim)], sizes, need_replication_factors=replicated, reduction_factors=reduced
  )


def _partition(config, mesh, arg_shapes, result_shape):
  """Each device multiplies its rows of A by its rows of B. A K split alike in A and B into
  whole 128-deep blocks (a weight gradient's tokens under data parallelism) stays split,
  with the scales of its k-blocks, and the devices' partial products are added
  (`sharding.split_k_results`); a K split otherwise is gathered."""
  (m, k), (n, _) = arg_shapes[0].shape, arg_shapes[1].shape
  m_axes, n_axes = sharding.gemm_row_axes(
    mesh,
    arg_shapes[0].sharding,
    arg_shapes[1].sharding,
    m,
    n,
    _ROWS_PER_SHARD,
    max(config.b_block_rows, _ROWS_PER_SHARD),
  )
  k_axes = sharding.gemm_k_axes(mesh, arg_shapes[0].sharding, arg_shapes[1].sharding, k, BLOCK)
  arg_specs = [
    sharding.pspec(m_axes, k_axes),
    sharding.pspec(n_axes, k_axes),
    sharding.pspec(k_axes, m_axes),
    sharding.pspec(k_axes, n_axes),
  ]
  return (
    arg_specs,
    *sharding.split_k_results(mesh, result_shape, k_axes, (m, n), (m_axes, n_axes)),
  )


def _workspace_dims(config, a, b, sfa, sfb):
  """For B's tile scales in cuBLASLt's layout and cuBLASLt's (or CUTLASS's) own workspace."""
  (m, k), n = a.shape, b.shape[0]
  f32_out = int(jnp.dtype(config.out_dtype) == jnp.float32)
  return m, n, k, config.b_block_rows, f32_out


SPEC = primitive.KernelSpec(
  name="jaxquant_block_fp8_gemm",
  abstract_eval=_abstract_eval,
  reference=_reference,
  partition=_partition,
  sharding_rule=_sharding_rule,
  workspace_dims=_workspace_dims,
)
block_gemm_p = primitive.define(SPEC)


def unsupported_reason(m: int, n: int, k: int, b_block_rows: int, out_dtype) -> str | None:
  """Why the kernel cannot run this problem, or None (TMA wants 16-byte aligned rows, A's
  MN-major scale rows [ceil(K/128), M] of fp32 included)."""
  if b_block_rows not in (1, BLOCK):
    return f"B's blocks must be 1x128 or 128x128, got {b_block_rows}x128"
  if m % 4:
    return f"M = {m} must be a multiple of 4 (A's scales are read as rows of M float32s)"
  return validate.gemm_shape_reason(n, k, out_dtype)


def block_fp8_gemm(
  a: jax.Array,
  b: jax.Array,
  a_scales: jax.Array,
  b_scales: jax.Array,
  *,
  b_block_rows: int,
  out_dtype=jnp.float32,
) -> jax.Array:
  """D = A . B^T from E4M3 codes and their decode scales in the stored (K-major) layout:
  a_scales [M, ceil(K/128)], b_scales [ceil(N/b_block_rows), ceil(K/128)]."""
  m, n, k = validate.check_gemm_operands(a, b, "block_fp8_gemm")
  for what, x in (("A", a), ("B", b)):
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.float8_e4m3fn):
      raise ValueError(
        f"block_fp8_gemm: {what} must be float8_e4m3fn, got {jnp.dtype(x.dtype).name}"
      )
  reason = unsupported_reason(m, n, k, b_block_rows, out_dtype)
  if reason:
    raise ValueError(f"block_fp8_gemm: {reason}")
  kb = -(-k // BLOCK)
  for what, s, rows in (("A", a_scales, m), ("B", b_scales, -(-n // b_block_rows))):
    if tuple(jnp.shape(s)) != (rows, kb) or jnp.dtype(s.dtype) != jnp.dtype(jnp.float32):
      raise ValueError(
        f"block_fp8_gemm: {what}'s scales must be float32[{rows}, {kb}], got "
        f"{jnp.dtype(s.dtype).name}{list(jnp.shape(s))}"
      )
  config = BlockGemmConfig(b_block_rows=b_block_rows, out_dtype=jnp.dtype(out_dtype).name)
  return block_gemm_p.bind(a, b, a_scales.T, b_scales.T, config=config)[0]
