"""The one GEMM dispatch point: C[m, n] = sum_k A[m, k] * B[n, k] ("TN").

Operands are one usage each: a `QuantizedData` in its stored layout (rows x k) or a
high-precision [rows, k] array; or NVFP4's values as its values kernel writes them
(kernels/_gemm_values.py `ScaledValues`), beside another or MXFP8's bf16 values. The
implementation is chosen from the platform and the pair of operand families; a kernel is
one more entry in `_IMPLEMENTATIONS`, never a branch in an op. The reference emulation (dequantize with block scales, fp32 `dot_general`, outer
scales in the epilogue) serves every pair, mixed ones included, on every platform.

Every implementation takes `fast_accumulation`: leave to the kernel the promotion of FP8
tensor-core sums along k (recipes.CustomRecipe.fast_accumulation). Only the per-tensor FP8
GEMM has such a mode; the others accumulate in fp32 whatever it says.
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp

from jaxquant import kernels
from jaxquant.formats import Family
from jaxquant.kernels import _bf16_gemm as bf16_gemm
from jaxquant.kernels import _block_gemm as block_gemm
from jaxquant.kernels import _fused_dequant as fused_dequant
from jaxquant.kernels import _tensor_gemm as tensor_gemm
from jaxquant.kernels._gemm_values import ScaledValues
from jaxquant.reference import _nvfp4 as nvfp4
from jaxquant.reference import outer_scales, split_scales
from jaxquant.tensor import QuantizedData

Operand = Union[QuantizedData, jax.Array, ScaledValues]
GemmFn = Callable[..., jax.Array]


def _family(op: Operand) -> Optional[Family]:
  return op.format.family if isinstance(op, QuantizedData) else None


def _exact_in_bf16(op: QuantizedData) -> bool:
  """Whether the operand's block-scaled values are exact in bf16: E4M3/E5M2 codes times a
  power of two (MXFP8, block FP8 with power-of-two scales), E2M1 times E4M3 (NVFP4: at
  most 6 significant bits), bare FP8 codes (per-tensor: the scale is applied in the
  epilogue). Block FP8 with arbitrary fp32 scales is not."""
  family = op.format.family
  if family is Family.FP8_BLOCK:
    return op.format.pow2_scales
  return family in (Family.FP8_TENSOR, Family.MXFP8, Family.NVFP4)


def _values(op: Operand, narrow: bool):
  """(operand values for the dot, outer scale or None)."""
  if not isinstance(op, QuantizedData):
    keep = narrow and op.dtype == jnp.bfloat16
    return op if keep else op.astype(jnp.float32), None
  values, outer = split_scales(op)
  if narrow and _exact_in_bf16(op):
    values = values.astype(jnp.bfloat16)
  return values, outer


def _epilogue(out, oa, ob, out_dtype):
  """Outer scales after the sum: A's per row (or scalar), B's per column (or scalar)."""
  # One fp32 epilogue factor per output element, S_dec_A[m] * S_dec_B[n], as cuBLAS's alpha.
  scale = None
  if oa is not None:
    scale = oa.reshape(-1, 1) if oa.ndim else oa
  if ob is not None:
    ob = ob.reshape(1, -1) if ob.ndim else ob
    scale = ob if scale is None else scale * ob
  if scale is not None:
    out = out * scale
  return out.astype(out_dtype)


# Contract dim 1 of both operands: C[m, n] = sum_k A[m, k] * B[n, k].
_TN = (((1,), (1,)), ((), ()))


def _scaled_dot(va, vb, oa, ob, out_dtype, precision=None):
  """fp32 sums of va . vb^T, then the outer scales and the rounding to out_dtype."""
  out = jax.lax.dot_general(va, vb, _TN, precision=precision, preferred_element_type=jnp.float32)
  return _epilogue(out, oa, ob, out_dtype)


def emulated_gemm(a: Operand, b: Operand, *, out_dtype=jnp.float32, narrow: bool = False):
  """Dequantize (block scales only), dot with fp32 accumulation, outer scales after.

  Outer scales (per-tensor FP8 scale_inv, NVFP4 S_dec, per-token S_dec rows) factor out
  of the sum. With `narrow`, operands whose values are exact in bf16 enter the dot as
  bf16 (tensor cores, same products, fp32 accumulation); otherwise fp32 at HIGHEST.
  """
  va, oa = _values(a, narrow)
  vb, ob = _values(b, narrow)
  if va.dtype != vb.dtype:
    va, vb = va.astype(jnp.float32), vb.astype(jnp.float32)
  precision = None if va.dtype == jnp.bfloat16 else jax.lax.Precision.HIGHEST
  return _scaled_dot(va, vb, oa, ob, out_dtype, precision)


def reference_gemm(
  a: Operand, b: Operand, *, out_dtype=jnp.float32, fast_accumulation: bool = False
) -> jax.Array:
  """The reference: emulation with fp32 operands, exact sums whatever `fast_accumulation`."""
  return emulated_gemm(a, b, out_dtype=out_dtype)


def _bf16_gemm(va, vb, oa, ob, out_dtype):
  """XLA's GEMM of bf16 values with fp32 accumulation. Without outer scales it rounds its
  fp32 sums to `out_dtype` itself: no fp32 result to write and convert."""
  if oa is None and ob is None and jnp.dtype(out_dtype) in (jnp.float32, jnp.bfloat16):
    return jax.lax.dot_general(va, vb, _TN, preferred_element_type=out_dtype)
  return _scaled_dot(va, vb, oa, ob, out_dtype)


def _gpu_emulated_gemm(
  a: Operand, b: Operand, *, out_dtype=jnp.float32, fast_accumulation: bool = False
) -> jax.Array:
  """XLA's dot. Two bf16 matrices (high precision, or the values a GEMM that dequantizes
  first multiplies, kernels/_gemm_values.py) go to it as they are."""
  if all(not isinstance(op, QuantizedData) and op.dtype == jnp.bfloat16 for op in (a, b)):
    return _bf16_gemm(a, b, None, None, out_dtype)
  return emulated_gemm(a, b, out_dtype=out_dtype, narrow=True)


def _fp8_tensor_gemm(
  a: QuantizedData, b: QuantizedData, *, out_dtype=jnp.float32, fast_accumulation: bool = False
) -> jax.Array:
  """Per-tensor FP8 x FP8: cuBLASLt's FP8 GEMM with the scales and the output rounding
  inside (the kernel), or else XLA's dot on f8 operands, which also reaches cuBLASLt but
  converts its fp32 result in a second pass. XLA picks its own accumulation for that dot
  (fast at the default precision), so it is asked for HIGHEST unless fast accumulation is
  allowed."""
  n, k = b.stored_shape
  if (
    kernels.available()
    and tensor_gemm.unsupported_reason(a.data.dtype, b.data.dtype, n, k, out_dtype) is None
  ):
    return tensor_gemm.fp8_tensor_gemm(
      a.data,
      b.data,
      a.scale_inv,
      b.scale_inv,
      out_dtype=out_dtype,
      fast_accumulation=fast_accumulation,
    )
  precision = None if fast_accumulation else jax.lax.Precision.HIGHEST
  return _scaled_dot(a.data, b.data, a.scale_inv, b.scale_inv, out_dtype, precision)


def _block_fp8_gemm(
  a: QuantizedData, b: QuantizedData, *, out_dtype=jnp.float32, fast_accumulation: bool = False
) -> jax.Array:
  """Block FP8 x block FP8: the block FP8 kernel (cuBLASLt's block-scaled FP8 GEMM, or
  jaxquant's CUTLASS blockwise kernel where cuBLASLt declines) for E4M3 with A in 1x128
  blocks and B in 1x128 blocks or 128x128 tiles (every GEMM of the fp8_block recipe); any
  other pair, or no kernels, takes the emulation."""
  n, k = b.stored_shape
  supported = (
    kernels.available()
    and a.format.element == b.format.element == "e4m3"
    and a.format.block == (1, 128)
    and b.format.block in ((1, 128), (128, 128))
    and block_gemm.unsupported_reason(a.stored_shape[0], n, k, b.format.block[0], out_dtype) is None
  )
  if not supported:
    return _gpu_emulated_gemm(a, b, out_dtype=out_dtype)
  return block_gemm.block_fp8_gemm(
    a.data, b.data, a.scale_inv, b.scale_inv, b_block_rows=b.format.block[0], out_dtype=out_dtype
  )


def _dequantize_first_gemm(
  a: QuantizedData, b: QuantizedData, *, out_dtype=jnp.float32, fast_accumulation: bool = False
) -> jax.Array:
  """Each operand's block-scaled values (exact in bf16) from the dequantize kernel, a bf16
  GEMM with fp32 accumulation, outer scales in the epilogue. The kernel's result is
  opaque to XLA, which would otherwise fuse the dequantization into a transposing fusion
  at a quarter of the copy bandwidth (docs/kernels.md). Per-tensor outer scales (NVFP4's
  S_dec) go to jaxquant's cuBLASLt GEMM as its alpha, which rounds the scaled sums
  to out_dtype itself; XLA's dot takes the rest (no outer scale, or per-token rows)."""
  va = kernels.dequantize_data(a, jnp.bfloat16, block_scales_only=True)
  vb = kernels.dequantize_data(b, jnp.bfloat16, block_scales_only=True)
  oa, ob = outer_scales(a, b, s_dec_of=kernels.decode_scale)
  return _outer_scaled_bf16_gemm(va, vb, oa, ob, out_dtype)


def _outer_scaled_bf16_gemm(va, vb, oa, ob, out_dtype, use_kernel: bool = True) -> jax.Array:
  """bf16 values with their outer scales (None, scalars, or per-token rows): per-tensor
  scales as the alpha of jaxquant's cuBLASLt GEMM, which rounds the scaled sums to
  out_dtype itself; XLA's dot takes the rest."""
  n, k = vb.shape
  scalars = [s for s in (oa, ob) if s is not None]
  if (
    use_kernel
    and scalars
    and all(s.ndim == 0 for s in scalars)
    and bf16_gemm.unsupported_reason(va.dtype, vb.dtype, n, k, out_dtype) is None
  ):
    scale = scalars[0] if len(scalars) == 1 else scalars[0] * scalars[1]  # as _epilogue's
    return bf16_gemm.scaled_bf16_gemm(va, vb, scale, out_dtype=out_dtype)
  return _bf16_gemm(va, vb, oa, ob, out_dtype)


def _scaled_values_gemm(a, b, *, out_dtype=jnp.float32, use_kernels: bool = True) -> jax.Array:
  """`_dequantize_first_gemm` on values the casts wrote (no dequantize pass): NVFP4's
  `ScaledValues` and MXFP8's bf16 values, in any pairing with at least one NVFP4 side
  (hybrids). The S_decs from one decode-scale call, their product cuBLASLt's alpha: the
  same bits. Without kernels: the reference's S_dec and XLA's dot with the scales after
  the sum."""
  use_kernels = use_kernels and kernels.available()
  sides = [(op.values, op.amax) if isinstance(op, ScaledValues) else (op, None) for op in (a, b)]
  (va, amax_a), (vb, amax_b) = sides
  amaxes = [amax for amax in (amax_a, amax_b) if amax is not None]
  s_dec_of = kernels.decode_scale if use_kernels else lambda amax: nvfp4.global_scales(amax)[1]
  s_dec = iter(s_dec_of(jnp.stack(amaxes)))
  oa, ob = (None if amax is None else next(s_dec) for amax in (amax_a, amax_b))
  return _outer_scaled_bf16_gemm(va, vb, oa, ob, out_dtype, use_kernel=use_kernels)


# The dequantize kernel's rule for k.
_DEQUANTIZE_K_MULTIPLE = 16


def _fused_dequant_gemm(
  a: QuantizedData, b: QuantizedData, *, out_dtype=jnp.float32, fast_accumulation: bool = False
) -> jax.Array:
  """MXFP8 / NVFP4 pairs: with at most 32 rows on one side (decode-like), the kernel that
  dequantizes in registers and reads the codes once; D^T = B . A^T when B is the short
  side. Larger problems dequantize first (kernel, then XLA's bf16 GEMM)."""
  if kernels.available():
    if fused_dequant.unsupported_reason(a, b, out_dtype) is None:
      return fused_dequant.dequant_gemm(a, b, out_dtype=out_dtype)
    if fused_dequant.unsupported_reason(b, a, out_dtype) is None:
      return fused_dequant.dequant_gemm(b, a, out_dtype=out_dtype).T
    if a.stored_shape[1] % _DEQUANTIZE_K_MULTIPLE == 0:
      return _dequantize_first_gemm(a, b, out_dtype=out_dtype)
  return _gpu_emulated_gemm(a, b, out_dtype=out_dtype)


def dequantizes_first(a_family: Family, b_family: Family, a_rows: int, b_rows: int, k: int) -> bool:
  """Whether `gemm` of operands of these families and shapes on this platform dequantizes
  both to bf16 and multiplies those (`_dequantize_first_gemm`): MXFP8 / NVFP4 pairs on a
  GPU with the kernels, unless the fused-dequantize kernel takes them."""
  if (
    not kernels.available()
    or _select(jax.default_backend(), a_family, b_family) is not _fused_dequant_gemm
  ):
    return False
  fused = any(fused_dequant.shape_reason(rows, k) is None for rows in (a_rows, b_rows))
  return not fused and k % _DEQUANTIZE_K_MULTIPLE == 0


_FUSED_DEQUANT = tuple(
  (("gpu", fa, fb), _fused_dequant_gemm)
  for fa in fused_dequant.FAMILIES
  for fb in fused_dequant.FAMILIES
)

# (platform, A family, B family) -> implementation; None matches any family. Kernels
# are new entries here. The first matching key in this order wins.
_IMPLEMENTATIONS: tuple[tuple[tuple[str, Optional[Family], Optional[Family]], GemmFn], ...] = (
  (("gpu", Family.FP8_TENSOR, Family.FP8_TENSOR), _fp8_tensor_gemm),
  (("gpu", Family.FP8_BLOCK, Family.FP8_BLOCK), _block_fp8_gemm),
  *_FUSED_DEQUANT,
  (("gpu", None, None), _gpu_emulated_gemm),
)


def _select(platform: str, fa: Optional[Family], fb: Optional[Family]) -> GemmFn:
  for (plat, a_fam, b_fam), fn in _IMPLEMENTATIONS:
    if plat == platform and a_fam in (None, fa) and b_fam in (None, fb):
      return fn
  return reference_gemm


def gemm(
  a: Operand,
  b: Operand,
  *,
  out_dtype=jnp.float32,
  fast_accumulation: bool = False,
  implementation: Optional[str] = None,
) -> jax.Array:
  """C = A . B^T with both operands contiguous along k: [m, k] x [n, k] -> [m, n].

  `fast_accumulation` lets a per-tensor FP8 kernel accumulate in its fast mode (see the
  module docstring). `implementation="reference"` (or JAXQUANT_BACKEND=reference) forces
  the reference (for NVFP4 values, `ScaledValues`: XLA's dot of the values).
  """
  reference = implementation == "reference" or os.environ.get("JAXQUANT_BACKEND") == "reference"
  if any(isinstance(op, ScaledValues) for op in (a, b)):
    if any(isinstance(op, QuantizedData) for op in (a, b)):
      raise TypeError(
        "gemm: NVFP4 values (ScaledValues) multiply NVFP4 or MXFP8 values, not "
        f"codes: got {type(a).__name__} and {type(b).__name__}"
      )
    ka, kb = (op.values.shape[1] if isinstance(op, ScaledValues) else op.shape[1] for op in (a, b))
    if ka != kb:
      raise ValueError(f"gemm: contraction dims differ: A has k={ka}, B has k={kb}")
    return _scaled_values_gemm(a, b, out_dtype=out_dtype, use_kernels=not reference)
  ka = a.stored_shape[1] if isinstance(a, QuantizedData) else a.shape[1]
  kb = b.stored_shape[1] if isinstance(b, QuantizedData) else b.shape[1]
  if ka != kb:
    raise ValueError(f"gemm: contraction dims differ: A has k={ka}, B has k={kb}")
  if reference:
    return reference_gemm(a, b, out_dtype=out_dtype)
  fn = _select(jax.default_backend(), _family(a), _family(b))
  return fn(a, b, out_dtype=out_dtype, fast_accumulation=fast_accumulation)
