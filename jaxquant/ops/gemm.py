"""The one GEMM dispatch point: C[m, n] = sum_k A[m, k] * B[n, k] ("TN").

Operands are one usage each: a `QuantizedData` in its stored layout (rows x k) or a
high-precision [rows, k] array. The implementation is chosen from the pair of operand
families; a kernel is one more entry in `_IMPLEMENTATIONS`, never a branch in an op.
The reference emulation (dequantize with block scales, fp32 `dot_general`, outer scales
in the epilogue) serves every pair, mixed ones included, on every platform.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp

from jaxquant.formats import Family
from jaxquant.reference import split_scales
from jaxquant.tensor import QuantizedData

Operand = Union[QuantizedData, jax.Array]
GemmFn = Callable[..., jax.Array]


def _family(op: Operand) -> Optional[Family]:
  return op.format.family if isinstance(op, QuantizedData) else None


def _values(op: Operand):
  if isinstance(op, QuantizedData):
    return split_scales(op)
  return op.astype(jnp.float32), None


def reference_gemm(a: Operand, b: Operand, *, out_dtype=jnp.float32) -> jax.Array:
  """Emulated GEMM: fp32 products of block-scaled values, outer scales after.

  Outer scales (per-tensor FP8 scale_inv, NVFP4 S_dec, per-token S_dec rows) factor out
  of the sum: output row m is multiplied by A's (per-row) scale and column n by B's.
  """
  va, oa = _values(a)
  vb, ob = _values(b)
  out = jax.lax.dot_general(va, vb, (((1,), (1,)), ((), ())),
                            precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)
  if oa is not None:
    out = out * (oa.reshape(-1, 1) if oa.ndim else oa)
  if ob is not None:
    out = out * (ob.reshape(1, -1) if ob.ndim else ob)
  return out.astype(out_dtype)


# (A family, B family) -> implementation, per platform. Kernels add entries here.
_IMPLEMENTATIONS: dict[tuple[str, Optional[Family], Optional[Family]], GemmFn] = {}


def register(platform: str, a_family: Optional[Family], b_family: Optional[Family], fn: GemmFn):
  """Registers a GEMM implementation for an operand-family pair on a platform."""
  _IMPLEMENTATIONS[(platform, a_family, b_family)] = fn


def gemm(a: Operand, b: Operand, *, out_dtype=jnp.float32,
         implementation: Optional[str] = None) -> jax.Array:
  """C = A . B^T with both operands contiguous along k. Shapes [m, k] x [n, k] -> [m, n].

  `implementation="reference"` forces the emulation.
  """
  ka = a.stored_shape[1] if isinstance(a, QuantizedData) else a.shape[1]
  kb = b.stored_shape[1] if isinstance(b, QuantizedData) else b.shape[1]
  if ka != kb:
    raise ValueError(f"gemm: contraction dims differ: A has k={ka}, B has k={kb}")
  if implementation != "reference":
    platform = jax.default_backend()
    fn = _IMPLEMENTATIONS.get((platform, _family(a), _family(b)))
    if fn is not None:
      return fn(a, b, out_dtype=out_dtype)
  return reference_gemm(a, b, out_dtype=out_dtype)
