"""The one GEMM dispatch point: C[m, n] = sum_k A[m, k] * B[n, k] ("TN").

Operands are one usage each, of one of three kinds: a `QuantizedData` in its stored layout
(rows x k), whose kind is its format's family; a high-precision [rows, k] array
(HIGH_PRECISION), MXFP8's bf16 values from its values kernel among them; NVFP4's values as
its values kernel writes them (kernels/_gemm_values.py `ScaledValues`: SCALED_VALUES),
beside another or MXFP8's bf16 values.

`_ROUTES` is the table. Each route names the operand kinds it multiplies, the platform it
runs on (None: every one), the kernel it runs (a JAXQUANT_DISABLE_KERNELS name,
ops/_backend.py) with what that kernel needs of the problem, and the operand form it
consumes. `select` takes the first route that takes the problem and whose kernel runs; a
kernel is one more route, never a branch in an op, and a layer that asks how its operands
should come (`operand_form`) gets its answer from the same choice. The first route takes
the empty problems (no rows on a side, or k = 0): their result is zeros, and no kernel
ever sees an empty operand. The reference emulation (dequantize with block scales, fp32
`dot_general`, outer scales in the epilogue) serves every pair of codes or matrices, mixed
ones included, on every platform; under the reference backend it is the only route for
them.

Every route takes `fast_accumulation`: leave to the kernel the promotion of FP8
tensor-core sums along k (recipes.CustomRecipe.fast_accumulation). Only the per-tensor FP8
GEMM has such a mode; the others accumulate in fp32 whatever it says. Every route takes the
backend choice too: the kernels it may call inside (NVFP4's S_dec, the scaled bf16 GEMM).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp

from jaxquant import kernels
from jaxquant.formats import Family, Format
from jaxquant.kernels import _bf16_gemm as bf16_gemm
from jaxquant.kernels import _block_gemm as block_gemm
from jaxquant.kernels import _fused_dequant as fused_dequant
from jaxquant.kernels import _tensor_gemm as tensor_gemm
from jaxquant.kernels._gemm_values import ScaledValues
from jaxquant.ops._backend import Backend, read_backend
from jaxquant.reference import _nvfp4 as nvfp4
from jaxquant.reference import outer_scales, split_scales
from jaxquant.tensor import QuantizedData

Operand = Union[QuantizedData, jax.Array, ScaledValues]
GemmFn = Callable[..., jax.Array]

# The kinds of operand that are not codes (the others are their Family).
HIGH_PRECISION = "high_precision"
SCALED_VALUES = "scaled_values"
Kind = Union[Family, str]

# What a route consumes: operands as quantized (codes and scales), or the values a GEMM
# that dequantizes first multiplies, which a layer can cast its operands straight to.
CODES = "codes"
VALUES = "values"


class Side(NamedTuple):
  """What choosing a route reads of one operand: its kind, its format (codes only), rows."""

  kind: Kind
  format: Optional[Format]
  rows: int


class Problem(NamedTuple):
  """What choosing a route reads of one GEMM: A [m, k], B [n, k], the output dtype."""

  a: Side
  b: Side
  k: int
  out_dtype: jnp.dtype


def _side_and_k(op: Operand) -> tuple[Side, int]:
  if isinstance(op, QuantizedData):
    rows, k = op.stored_shape
    return Side(op.format.family, op.format, rows), k
  if isinstance(op, ScaledValues):
    rows, k = op.values.shape
    return Side(SCALED_VALUES, None, rows), k
  rows, k = op.shape
  return Side(HIGH_PRECISION, None, rows), k


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
  a: Operand, b: Operand, *, out_dtype=jnp.float32, fast_accumulation=False, backend=None
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
  a: Operand, b: Operand, *, out_dtype=jnp.float32, fast_accumulation=False, backend=None
) -> jax.Array:
  """XLA's dot. Two bf16 matrices (high precision, or the values a GEMM that dequantizes
  first multiplies, kernels/_gemm_values.py) go to it as they are."""
  if all(not isinstance(op, QuantizedData) and op.dtype == jnp.bfloat16 for op in (a, b)):
    return _bf16_gemm(a, b, None, None, out_dtype)
  return emulated_gemm(a, b, out_dtype=out_dtype, narrow=True)


def _fp8_tensor_kernel(
  a: QuantizedData,
  b: QuantizedData,
  *,
  out_dtype=jnp.float32,
  fast_accumulation=False,
  backend=None,
) -> jax.Array:
  """Per-tensor FP8 x FP8: cuBLASLt's FP8 GEMM with the scales and the output rounding
  inside."""
  return tensor_gemm.fp8_tensor_gemm(
    a.data,
    b.data,
    a.scale_inv,
    b.scale_inv,
    out_dtype=out_dtype,
    fast_accumulation=fast_accumulation,
  )


def _fp8_tensor_kernel_takes(p: Problem) -> bool:
  dtypes = (p.a.format.storage_dtype, p.b.format.storage_dtype)
  return tensor_gemm.unsupported_reason(*dtypes, p.b.rows, p.k, p.out_dtype) is None


def _fp8_tensor_dot(
  a: QuantizedData,
  b: QuantizedData,
  *,
  out_dtype=jnp.float32,
  fast_accumulation=False,
  backend=None,
) -> jax.Array:
  """Per-tensor FP8 x FP8 without the kernel: XLA's dot on f8 operands, which also reaches
  cuBLASLt but converts its fp32 result in a second pass. XLA picks its own accumulation for
  that dot (fast at the default precision), so it is asked for HIGHEST unless fast
  accumulation is allowed."""
  precision = None if fast_accumulation else jax.lax.Precision.HIGHEST
  return _scaled_dot(a.data, b.data, a.scale_inv, b.scale_inv, out_dtype, precision)


def _block_fp8_kernel(
  a: QuantizedData,
  b: QuantizedData,
  *,
  out_dtype=jnp.float32,
  fast_accumulation=False,
  backend=None,
) -> jax.Array:
  """Block FP8 x block FP8: cuBLASLt's block-scaled FP8 GEMM, or jaxquant's CUTLASS
  blockwise kernel where cuBLASLt declines."""
  return block_gemm.block_fp8_gemm(
    a.data, b.data, a.scale_inv, b.scale_inv, b_block_rows=b.format.block[0], out_dtype=out_dtype
  )


def _block_fp8_kernel_takes(p: Problem) -> bool:
  """E4M3 with A in 1x128 blocks and B in 1x128 blocks or 128x128 tiles: every GEMM of the
  fp8_block recipe."""
  a, b = p.a.format, p.b.format
  return (
    a.element == b.element == "e4m3"
    and a.block == (1, 128)
    and b.block in ((1, 128), (128, 128))
    and block_gemm.unsupported_reason(p.a.rows, p.b.rows, p.k, b.block[0], p.out_dtype) is None
  )


def _dequant_gemm(
  a: QuantizedData,
  b: QuantizedData,
  *,
  out_dtype=jnp.float32,
  fast_accumulation=False,
  backend=None,
) -> jax.Array:
  """MXFP8 / NVFP4 with at most 32 rows in A (decode-like): the kernel that dequantizes in
  registers and reads the codes once."""
  return fused_dequant.dequant_gemm(a, b, out_dtype=out_dtype)


def _dequant_gemm_transposed(
  a: QuantizedData,
  b: QuantizedData,
  *,
  out_dtype=jnp.float32,
  fast_accumulation=False,
  backend=None,
) -> jax.Array:
  """`_dequant_gemm` with B the short side: D^T = B . A^T."""
  return fused_dequant.dequant_gemm(b, a, out_dtype=out_dtype).T


def _dequant_gemm_takes(rows: int, p: Problem) -> bool:
  # The kernel's conditions (fused_dequant.unsupported_reason) on a short side of `rows`.
  return (
    fused_dequant.shape_reason(rows, p.k) is None
    and jnp.dtype(p.out_dtype) in fused_dequant.OUT_DTYPES
  )


def _dequantize_first_gemm(
  a: QuantizedData,
  b: QuantizedData,
  *,
  out_dtype=jnp.float32,
  fast_accumulation: bool = False,
  backend: Optional[Backend] = None,
) -> jax.Array:
  """Each operand's block-scaled values (exact in bf16) from the dequantize kernel, a bf16
  GEMM with fp32 accumulation, outer scales in the epilogue. The kernel's result is
  opaque to XLA, which would otherwise fuse the dequantization into a transposing fusion
  at a quarter of the copy bandwidth (docs/kernels.md). Per-tensor outer scales (NVFP4's
  S_dec, from one decode-scale call) go to jaxquant's cuBLASLt GEMM as its alpha, which
  rounds the scaled sums to out_dtype itself; XLA's dot takes the rest (no outer scale, or
  per-token rows). Without `backend`, the one read now."""
  backend = backend or read_backend()
  va = kernels.dequantize_data(a, jnp.bfloat16, block_scales_only=True)
  vb = kernels.dequantize_data(b, jnp.bfloat16, block_scales_only=True)
  s_dec_of = kernels.decode_scale if backend.allows("decode_scale") else None  # None: reference
  oa, ob = outer_scales(a, b, s_dec_of=s_dec_of)
  return _outer_scaled_bf16_gemm(va, vb, oa, ob, out_dtype, backend.allows("scaled_bf16_gemm"))


# The dequantize kernel's rule for k.
_DEQUANTIZE_K_MULTIPLE = 16


def _outer_scaled_bf16_gemm(va, vb, oa, ob, out_dtype, use_kernel: bool) -> jax.Array:
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


def _scaled_values_gemm(
  a, b, *, out_dtype=jnp.float32, fast_accumulation: bool = False, backend: Backend
) -> jax.Array:
  """`_dequantize_first_gemm` on values the casts wrote (no dequantize pass): NVFP4's
  `ScaledValues` and MXFP8's bf16 values, in any pairing with at least one NVFP4 side
  (hybrids). The S_decs from one decode-scale call, their product cuBLASLt's alpha: the
  same bits. Where those kernels do not run: the reference's S_dec and XLA's dot with the
  scales after the sum."""
  sides = [(op.values, op.amax) if isinstance(op, ScaledValues) else (op, None) for op in (a, b)]
  (va, amax_a), (vb, amax_b) = sides
  amaxes = [amax for amax in (amax_a, amax_b) if amax is not None]
  s_dec_of = (
    kernels.decode_scale
    if backend.runs("decode_scale")
    else lambda amax: nvfp4.global_scales(amax)[1]
  )
  s_dec = iter(s_dec_of(jnp.stack(amaxes)))
  oa, ob = (None if amax is None else next(s_dec) for amax in (amax_a, amax_b))
  return _outer_scaled_bf16_gemm(va, vb, oa, ob, out_dtype, backend.runs("scaled_bf16_gemm"))


def _empty_gemm(
  a: Operand, b: Operand, *, out_dtype=jnp.float32, fast_accumulation=False, backend=None
) -> jax.Array:
  """No rows on a side, or an empty sum: C is [m, n] zeros (the sums over k = 0 are 0, as
  jnp.dot's), with no kernel launched on an empty operand."""
  (side_a, _), (side_b, _) = _side_and_k(a), _side_and_k(b)
  return jnp.zeros((side_a.rows, side_b.rows), out_dtype)


def _is_empty(p: Problem) -> bool:
  return 0 in (p.a.rows, p.b.rows, p.k)


def _takes_all(p: Problem) -> bool:
  return True


@dataclasses.dataclass(frozen=True)
class Route:
  """One way to run a GEMM, and what it takes."""

  name: str
  run: GemmFn
  a: tuple[Kind, ...]  # the operand kinds it multiplies
  b: tuple[Kind, ...]
  platform: Optional[str] = None  # None: every platform
  kernel: Optional[str] = None  # the kernel it runs (ops/_backend.py KERNELS), if any
  takes: Callable[[Problem], bool] = _takes_all  # what else the kernel needs of the problem
  form: str = CODES  # what it consumes: CODES, or VALUES (it dequantizes first)


_FP8_TENSOR = (Family.FP8_TENSOR,)
_FP8_BLOCK = (Family.FP8_BLOCK,)
_MX_NV = fused_dequant.FAMILIES  # MXFP8, NVFP4
_CODES_OR_MATRIX = (*Family, HIGH_PRECISION)
_VALUES = (SCALED_VALUES, HIGH_PRECISION)

# The first route that takes a problem wins.
_ROUTES = (
  # Before every kernel: none is launched on an empty operand.
  Route(
    "empty",
    _empty_gemm,
    a=(*_CODES_OR_MATRIX, SCALED_VALUES),
    b=(*_CODES_OR_MATRIX, SCALED_VALUES),
    takes=_is_empty,
  ),
  Route(
    "fp8_tensor_gemm",
    _fp8_tensor_kernel,
    a=_FP8_TENSOR,
    b=_FP8_TENSOR,
    platform="gpu",
    kernel="fp8_tensor_gemm",
    takes=_fp8_tensor_kernel_takes,
  ),
  Route("fp8_tensor_dot", _fp8_tensor_dot, a=_FP8_TENSOR, b=_FP8_TENSOR, platform="gpu"),
  Route(
    "block_fp8_gemm",
    _block_fp8_kernel,
    a=_FP8_BLOCK,
    b=_FP8_BLOCK,
    platform="gpu",
    kernel="block_fp8_gemm",
    takes=_block_fp8_kernel_takes,
  ),
  Route(
    "dequant_gemm",
    _dequant_gemm,
    a=_MX_NV,
    b=_MX_NV,
    platform="gpu",
    kernel="dequant_gemm",
    takes=lambda p: _dequant_gemm_takes(p.a.rows, p),
  ),
  Route(
    "dequant_gemm_transposed",
    _dequant_gemm_transposed,
    a=_MX_NV,
    b=_MX_NV,
    platform="gpu",
    kernel="dequant_gemm",
    takes=lambda p: _dequant_gemm_takes(p.b.rows, p),
  ),
  Route(
    "dequantize_first",
    _dequantize_first_gemm,
    a=_MX_NV,
    b=_MX_NV,
    platform="gpu",
    kernel="dequantize_data",
    takes=lambda p: p.k % _DEQUANTIZE_K_MULTIPLE == 0,
    form=VALUES,
  ),
  # NVFP4 values with NVFP4's or MXFP8's, on every platform and backend.
  Route(
    "scaled_values",
    _scaled_values_gemm,
    a=_VALUES,
    b=_VALUES,
    takes=lambda p: SCALED_VALUES in (p.a.kind, p.b.kind),
  ),
  # XLA's dot, narrowed to bf16 where the values are exact in it.
  Route("xla_dot", _gpu_emulated_gemm, a=_CODES_OR_MATRIX, b=_CODES_OR_MATRIX, platform="gpu"),
  Route("reference", reference_gemm, a=_CODES_OR_MATRIX, b=_CODES_OR_MATRIX),
)


def select(problem: Problem, platform: str, backend: Backend) -> Route:
  """The route `gemm` takes for `problem` on `platform` (as `jax.default_backend()` names
  it) under `backend`: the first of `_ROUTES` that multiplies these kinds there, whose
  kernel runs and takes the problem. The reference backend leaves no platform's own route."""
  on = None if backend.choice == "reference" else platform
  for route in _ROUTES:
    if (
      problem.a.kind in route.a
      and problem.b.kind in route.b
      and route.platform in (None, on)
      and (route.kernel is None or backend.runs(route.kernel))
      and route.takes(problem)
    ):
      return route
  raise TypeError(
    f"gemm: no route multiplies {problem.a.kind} by {problem.b.kind}: NVFP4 values "
    "(ScaledValues) multiply NVFP4 or MXFP8 values, not codes"
  )


def operand_form(
  a_format: Format, b_format: Format, a_rows: int, b_rows: int, k: int, backend: Backend
) -> str:
  """What `gemm` of operands of these formats and shapes consumes on this platform: CODES,
  or VALUES when its route dequantizes first (then a layer may cast its operands straight
  to those values, kernels/_gemm_values.py). The question is asked of fp32 sums: the
  output dtype, which a layer chooses per call, changes only whether the fused-dequantize
  kernel takes a pair, so values are asked for only where no output dtype could take it."""
  problem = Problem(
    Side(a_format.family, a_format, a_rows),
    Side(b_format.family, b_format, b_rows),
    k,
    jnp.dtype(jnp.float32),
  )
  return select(problem, jax.default_backend(), backend).form


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
  module docstring). `implementation` overrides JAXQUANT_BACKEND (ops/_backend.py):
  "reference" takes the reference (for NVFP4 values, `ScaledValues`: XLA's dot of the
  values).
  """
  (side_a, ka), (side_b, kb) = _side_and_k(a), _side_and_k(b)
  if ka != kb:
    raise ValueError(f"gemm: contraction dims differ: A has k={ka}, B has k={kb}")
  backend = read_backend(implementation)
  route = select(Problem(side_a, side_b, ka, jnp.dtype(out_dtype)), jax.default_backend(), backend)
  return route.run(a, b, out_dtype=out_dtype, fast_accumulation=fast_accumulation, backend=backend)
