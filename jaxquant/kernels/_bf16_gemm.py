"""Scaled bf16 GEMM through cuBLASLt: D = scale * (A . B^T), rounded once.

A [M, K] and B [N, K] are bf16 values in their stored (K-major) layout, scale a float32
scalar on the device. cuBLASLt multiplies the fp32 sums by it (its alpha, read from the
device with its beta, 0) and writes bf16 or fp32 itself (ffi/gemm/scaled_bf16_gemm.cu). It
is the GEMM of MXFP8 / NVFP4 operands that dequantize first with per-tensor outer scales
(NVFP4's S_dec, ops/_gemm.py): XLA's dot cannot take a runtime scale, so it writes fp32 sums
for its consumers to scale and round, twice the bytes of a bf16 result out and back in.
The kernel's results are the reference's but for the sign of zero: cuBLASLt's epilogue
writes +0 where the scaled sum is -0 (docs/kernels.md). Elsewhere the lowering is the
reference: one fp32 dot, the scale, the rounding. Under a sharded jit A's and B's rows
stay on their devices, and a K split alike in both is summed in parts whose scaled
partial products the devices add (`sharding.split_k_results`), as the per-tensor FP8
GEMM's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.core import ShapedArray

from jaxquant.kernels import _primitive as primitive
from jaxquant.kernels import _sharding as sharding
from jaxquant.kernels import _validate as validate


@dataclasses.dataclass(frozen=True)
class ScaledGemmConfig:
  out_dtype: str

  def ffi_attributes(self) -> dict:
    return {}


def _abstract_eval(a, b, alpha_beta, *, config):
  return [ShapedArray((a.shape[0], b.shape[0]), jnp.dtype(config.out_dtype))]


def _reference(a, b, alpha_beta, *, config):
  sums = jax.lax.dot_general(
    a.astype(jnp.float32),
    b.astype(jnp.float32),
    (((1,), (1,)), ((), ())),
    precision=jax.lax.Precision.HIGHEST,
    preferred_element_type=jnp.float32,
  )
  return [(sums * alpha_beta[0]).astype(config.out_dtype)]


# As the per-tensor FP8 GEMM's (tensor_gemm.py): whole 16-row multiples per shard, a split
# K a multiple of 16 per shard.
_ROWS_PER_SHARD = 16
_K_PER_SHARD = 16


def _sharding_rule(config, shapes, mesh_size):
  return sharding.rule(
    [("m", "k"), ("n", "k"), ("two",)],
    [("m", "n")],
    {},
    reduction_factors=("k",),
    need_replication_factors=("two",),
  )


def _partition(config, mesh, arg_shapes, result_shape):
  return sharding.scaled_gemm_partition(
    mesh, arg_shapes, result_shape, rows_multiple=_ROWS_PER_SHARD, k_multiple=_K_PER_SHARD
  )


def _workspace_dims(config, a, b, alpha_beta):
  """cuBLASLt's workspace, for its dynamically scheduled kernels beside other devices'
  collectives (ffi/gemm/fp8_tensor_gemm.cu)."""
  return a.shape[0], b.shape[0]


SPEC = primitive.KernelSpec(
  name="jaxquant_scaled_bf16_gemm",
  abstract_eval=_abstract_eval,
  reference=_reference,
  partition=_partition,
  sharding_rule=_sharding_rule,
  workspace_dims=_workspace_dims,
  workspace_only_across_devices=True,
)
scaled_bf16_gemm_p = primitive.define(SPEC)


def unsupported_reason(a_dtype, b_dtype, n: int, k: int, out_dtype) -> str | None:
  """Why the kernel cannot run this problem, or None: bf16 operands, bf16 / fp32 output,
  K a multiple of 16 and 16-byte aligned output rows (the rules of jaxquant's other
  cuBLASLt GEMMs)."""
  if jnp.dtype(a_dtype) != jnp.dtype(jnp.bfloat16) or jnp.dtype(b_dtype) != jnp.dtype(jnp.bfloat16):
    return f"operands must be bfloat16, got {jnp.dtype(a_dtype).name} and {jnp.dtype(b_dtype).name}"
  return validate.gemm_shape_reason(n, k, out_dtype)


def scaled_bf16_gemm(
  a: jax.Array, b: jax.Array, scale: jax.Array, *, out_dtype=jnp.float32
) -> jax.Array:
  """D [M, N] = scale * (A . B^T) from bf16 A [M, K] and B [N, K] and a float32 scalar
  scale: the scaled fp32 sums rounded once to out_dtype."""
  _, n, k = validate.check_gemm_operands(a, b, "scaled_bf16_gemm")
  reason = unsupported_reason(a.dtype, b.dtype, n, k, out_dtype)
  if reason:
    raise ValueError(f"scaled_bf16_gemm: {reason}")
  validate.check_array(scale, "scaled_bf16_gemm: scale", (), jnp.float32)
  config = ScaledGemmConfig(out_dtype=jnp.dtype(out_dtype).name)
  # cuBLASLt's alpha and beta (0: D is not read), both read from the device.
  alpha_beta = jnp.stack([scale, jnp.zeros((), jnp.float32)])
  return scaled_bf16_gemm_p.bind(a, b, alpha_beta, config=config)[0]
