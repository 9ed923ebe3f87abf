"""Per-tensor FP8 GEMM through cuBLASLt: D = (sa * sb) * (A . B^T), rounded once.

A [M, K] and B [N, K] are FP8 codes in their stored (K-major) layout, sa and sb their
per-tensor decode scales (float32 scalars, on the device: no host sync). cuBLASLt applies
the scales to the fp32 sums and writes bf16 or fp32 itself (ffi/gemm/fp8_tensor_gemm.cu);
XLA's dot on f8 operands writes fp32 and converts in a second pass. Elsewhere the lowering
is the reference: codes to fp32, one fp32 dot, then the scales, then the rounding. Under a
sharded jit, A's rows (tokens) and B's rows (output features) stay on their devices, and
a K split alike in both (a weight gradient's tokens) is summed in parts, whose partial
products the devices add (`_partition`). `fast_accumulation` is cuBLASLt's
FAST_ACCUM mode (lt_gemm.h); the reference's sums are exact with or without it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.core import ShapedArray

from jaxquant.kernels import _primitive as primitive
from jaxquant.kernels import _sharding as sharding
from jaxquant.kernels import _validate as validate

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


@dataclasses.dataclass(frozen=True)
class Fp8GemmConfig:
  out_dtype: str
  fast_accumulation: bool = False

  def ffi_attributes(self) -> dict:
    return {"fast_accumulation": self.fast_accumulation}


def _abstract_eval(a, b, sa, sb, *, config):
  return [ShapedArray((a.shape[0], b.shape[0]), jnp.dtype(config.out_dtype))]


def _reference(a, b, sa, sb, *, config):
  out = jax.lax.dot_general(
    a.astype(jnp.float32),
    b.astype(jnp.float32),
    (((1,), (1,)), ((), ())),
    precision=jax.lax.Precision.HIGHEST,
    preferred_element_type=jnp.float32,
  )
  return [(out * (sa * sb)).astype(config.out_dtype)]


# Rows per shard for A's and B's rows to stay sharded: cuBLASLt wants D's rows (N
# elements) 16-byte aligned, and whole 16-row multiples keep its tiles full. A split K
# keeps cuBLASLt's FP8 rule: a multiple of 16 per shard.
_ROWS_PER_SHARD = 16
_K_PER_SHARD = 16


def _sharding_rule(config, shapes, mesh_size):
  return sharding.rule([("m", "k"), ("n", "k"), (), ()], [("m", "n")], {}, reduction_factors=("k",))


def _partition(config, mesh, arg_shapes, result_shape):
  """Each device multiplies its rows of A by its rows of B. A K split alike in A and B (a
  weight gradient's tokens under data parallelism, a row-parallel layer's inputs under
  tensor parallelism) stays split: each device sums its part of K and the partial
  products, in the output dtype as XLA's own partitioned dots have theirs, are added
  across the devices (reduce-scattered where the result is wanted split over the same
  axes, else all-reduced). A K split otherwise is gathered."""
  return sharding.scaled_gemm_partition(
    mesh, arg_shapes, result_shape, rows_multiple=_ROWS_PER_SHARD, k_multiple=_K_PER_SHARD
  )


def _workspace_dims(config, a, b, sa, sb):
  """cuBLASLt's workspace, for its dynamically scheduled kernels beside other devices'
  collectives (ffi/gemm/fp8_tensor_gemm.cu)."""
  return a.shape[0], b.shape[0]


SPEC = primitive.KernelSpec(
  name="jaxquant_fp8_tensor_gemm",
  abstract_eval=_abstract_eval,
  reference=_reference,
  partition=_partition,
  sharding_rule=_sharding_rule,
  workspace_dims=_workspace_dims,
  workspace_only_across_devices=True,
)
tensor_gemm_p = primitive.define(SPEC)


def unsupported_reason(a_dtype, b_dtype, n: int, k: int, out_dtype) -> str | None:
  """Why cuBLASLt's FP8 GEMM cannot run this problem, or None: it takes E4M3 x E4M3,
  E4M3 x E5M2 and E5M2 x E4M3, K a multiple of 16 and 16-byte aligned output rows."""
  a_dtype, b_dtype = jnp.dtype(a_dtype), jnp.dtype(b_dtype)
  if a_dtype not in FP8_DTYPES or b_dtype not in FP8_DTYPES:
    return f"operands must be float8_e4m3fn or float8_e5m2, got {a_dtype.name} and {b_dtype.name}"
  if a_dtype == b_dtype == jnp.dtype(jnp.float8_e5m2):
    return "E5M2 x E5M2 has no FP8 tensor-core GEMM"
  return validate.gemm_shape_reason(n, k, out_dtype)


def fp8_tensor_gemm(
  a: jax.Array,
  b: jax.Array,
  a_scale_inv: jax.Array,
  b_scale_inv: jax.Array,
  *,
  out_dtype=jnp.float32,
  fast_accumulation: bool = False,
) -> jax.Array:
  """D = (a_scale_inv * b_scale_inv) * (A . B^T) from FP8 codes A [M, K] and B [N, K];
  with `fast_accumulation`, cuBLASLt's faster, less accurate FP8 accumulation."""
  _, n, k = validate.check_gemm_operands(a, b, "fp8_tensor_gemm")
  reason = unsupported_reason(a.dtype, b.dtype, n, k, out_dtype)
  if reason:
    raise ValueError(f"fp8_tensor_gemm: {reason}")
  for what, s in (("A", a_scale_inv), ("B", b_scale_inv)):
    if jnp.shape(s) != () or jnp.dtype(s.dtype) != jnp.dtype(jnp.float32):
      raise ValueError(
        f"fp8_tensor_gemm: {what}'s scale must be a float32 scalar, got "
        f"{jnp.dtype(s.dtype).name}{list(jnp.shape(s))}"
      )
  if not isinstance(fast_accumulation, bool):
    raise TypeError(f"fp8_tensor_gemm: fast_accumulation must be a bool, got {fast_accumulation!r}")
  config = Fp8GemmConfig(out_dtype=jnp.dtype(out_dtype).name, fast_accumulation=fast_accumulation)
  return tensor_gemm_p.bind(a, b, a_scale_inv, b_scale_inv, config=config)[0]
