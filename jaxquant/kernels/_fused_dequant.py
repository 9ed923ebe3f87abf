"""Fused-dequantize GEMM for few rows: D = A . B^T, A [M <= 32, K] and B [N, K] each MXFP8 or
NVFP4 (1-D blocks or 16x16 tiles, per-tensor or per-row global scale), in any pairing.

The kernel (ffi/gemm/dequant_gemm.cu) reads the codes once, turns them into bf16 in
registers (code times block scale, exact) and multiplies on bf16 tensor cores with fp32
accumulation; the outer scales (NVFP4's S_dec, from the global amax) multiply the sum,
`S_dec_A[m] * S_dec_B[n]`, as in the reference. It is the decode-shaped member of the
fused-dequantize family: with few rows a GEMM is a read of B, and the codes are a half
(MXFP8) or a quarter (NVFP4) of the bytes of the bf16 weight that a dequantize-first GEMM
reads. Elsewhere the lowering is
the reference: dequantize both operands, one fp32 dot, the same epilogue. Under a sharded
`jit` B's rows (output features) stay on their devices; A and a sharded K are gathered.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jaxquant.formats import Family, Format
from jaxquant.kernels import _primitive as primitive
from jaxquant.kernels import _sharding as sharding
from jaxquant.kernels import _validate as validate
from jaxquant.kernels._config import ELEMENT_CODES
from jaxquant.reference import _mxfp8 as mxfp8
from jaxquant.reference import _nvfp4 as nvfp4
from jaxquant.tensor import QuantizedData

MAX_ROWS = 32
K_MULTIPLE = 128
OUT_DTYPES = validate.GEMM_OUT_DTYPES
FAMILIES = (Family.MXFP8, Family.NVFP4)


@dataclasses.dataclass(frozen=True)
class DequantGemmConfig:
  a_format: Format
  b_format: Format
  out_dtype: str

  def ffi_attributes(self) -> dict:
    shift = lambda fmt: np.int32(int(fmt.block[0]).bit_length() - 1)
    return {
      "a_element": np.int32(ELEMENT_CODES[self.a_format.element]),
      "b_element": np.int32(ELEMENT_CODES[self.b_format.element]),
      "a_scale_row_shift": shift(self.a_format),
      "b_scale_row_shift": shift(self.b_format),
    }


def _rows_k(data, fmt: Format) -> tuple[int, int]:
  rows, cols = data.shape
  return rows, 2 * cols if fmt.packed else cols


def _abstract_eval(a, sa, amax_a, b, sb, amax_b, *, config):
  return [ShapedArray((a.shape[0], b.shape[0]), jnp.dtype(config.out_dtype))]


def _values(data, scale, fmt: Format):
  qd = QuantizedData(data, scale, None, fmt)
  return (mxfp8 if fmt.family is Family.MXFP8 else nvfp4).dequantize_values(qd)


def _decode_scale(amax, fmt: Format):
  return nvfp4.global_scales(amax)[1] if fmt.family is Family.NVFP4 else jnp.float32(1.0)


def _reference(a, sa, amax_a, b, sb, amax_b, *, config):
  """ops.gemm's reference: block-scaled values, fp32 dot, outer scales (S_dec) after."""
  va, vb = _values(a, sa, config.a_format), _values(b, sb, config.b_format)
  oa, ob = _decode_scale(amax_a, config.a_format), _decode_scale(amax_b, config.b_format)
  out = jax.lax.dot_general(
    va,
    vb,
    (((1,), (1,)), ((), ())),
    precision=jax.lax.Precision.HIGHEST,
    preferred_element_type=jnp.float32,
  )
  scale = (oa.reshape(-1, 1) if oa.ndim else oa) * (ob.reshape(1, -1) if ob.ndim else ob)
  return [(out * scale).astype(config.out_dtype)]


def _sharding_rule(config, shapes, mesh_size):
  """B's rows (N) may stay sharded when its scales are per row (1-D blocks); A (at most 32
  rows), K and 16x16-tiled B are whole."""
  per_row = config.b_format.block[0] == 1
  b_rows, b_scale_rows = ("n", "n") if per_row else ("nr", "ns")
  a_outer = ("m",) if shapes[2] else ()  # per row, or a scalar
  b_outer = (b_rows,) if shapes[5] else ()
  operands = [("m", "ka"), ("ms", "kas"), a_outer, (b_rows, "kb"), (b_scale_rows, "kbs"), b_outer]
  # Shardy wants the replicated factors in the order they first appear.
  names = dict.fromkeys(f for t in operands for f in t)
  replicated = tuple(f for f in names if not (per_row and f == "n"))
  return sharding.rule(operands, [("m", b_rows)], {}, need_replication_factors=replicated)


def _partition(config, mesh, arg_shapes, result_shape):
  n = arg_shapes[3].shape[0]
  n_axes: tuple[str, ...] = ()
  if config.b_format.block[0] == 1:
    n_axes = sharding.keep_if_whole(mesh, sharding.spec_axes(arg_shapes[3].sharding, 2)[0], n, 1)
  whole = sharding.pspec()
  b_outer = sharding.pspec(n_axes) if arg_shapes[5].shape else whole
  arg_specs = [whole, whole, whole, sharding.pspec(n_axes), sharding.pspec(n_axes), b_outer]
  return arg_specs, [sharding.pspec((), n_axes)], lambda kernel, *shards: kernel(*shards)


def _workspace_dims(config, a, sa, amax_a, b, sb, amax_b):
  (m, k), n = _rows_k(a, config.a_format), b.shape[0]
  attrs = config.ffi_attributes()
  return m, n, k, int(attrs["a_element"]), int(attrs["b_element"])


SPEC = primitive.KernelSpec(
  name="jaxquant_dequant_gemm",
  abstract_eval=_abstract_eval,
  reference=_reference,
  partition=_partition,
  sharding_rule=_sharding_rule,
  workspace_dims=_workspace_dims,
)
dequant_gemm_p = primitive.define(SPEC)


def shape_reason(a_rows: int, k: int) -> str | None:
  """Why the kernel cannot take an A of `a_rows` rows and contraction length k, or None."""
  if a_rows > MAX_ROWS:
    return f"A has {a_rows} rows; the kernel takes at most {MAX_ROWS}"
  if k % K_MULTIPLE:
    return f"K = {k} must be a multiple of {K_MULTIPLE}"
  return None


def unsupported_reason(a: QuantizedData, b: QuantizedData, out_dtype) -> str | None:
  """Why the kernel cannot take this pair, or None."""
  for what, op in (("A", a), ("B", b)):
    if op.format.family not in FAMILIES:
      return f"{what} is {op.format.family.value}; the kernel takes MXFP8 and NVFP4"
  reason = shape_reason(*_rows_k(a.data, a.format))
  if reason:
    return reason
  if jnp.dtype(out_dtype) not in OUT_DTYPES:
    return f"the output dtype must be bfloat16 or float32, got {jnp.dtype(out_dtype).name}"
  return None


def _global_amax(op: QuantizedData) -> jax.Array:
  """NVFP4's global amax, float32 [] or [rows], from which the kernel derives S_dec (in XLA
  that exact division is a handful of small kernels per call); an unread scalar for MXFP8."""
  if op.format.family is Family.MXFP8:
    return jnp.float32(0.0)
  return jnp.asarray(op.amax, jnp.float32)


def dequant_gemm(a: QuantizedData, b: QuantizedData, *, out_dtype=jnp.float32) -> jax.Array:
  """D = A . B^T for MXFP8 / NVFP4 operands in their stored layout (see the module doc)."""
  reason = unsupported_reason(a, b, out_dtype)
  if reason:
    raise ValueError(f"dequant_gemm: {reason}")
  ka, kb = _rows_k(a.data, a.format)[1], _rows_k(b.data, b.format)[1]
  if ka != kb:
    raise ValueError(f"dequant_gemm: contraction dims differ: A has K={ka}, B has K={kb}")
  config = DequantGemmConfig(a.format, b.format, jnp.dtype(out_dtype).name)
  as_bytes = lambda s: jax.lax.bitcast_convert_type(s, jnp.uint8)
  return dequant_gemm_p.bind(
    a.data,
    as_bytes(a.scale_inv),
    _global_amax(a),
    b.data,
    as_bytes(b.scale_inv),
    _global_amax(b),
    config=config,
  )[0]
