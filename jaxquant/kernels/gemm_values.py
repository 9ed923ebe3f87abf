"""MXFP8 quantized straight to the values a GEMM multiplies, by a kernel.

Hopper has no MXFP8 tensor cores: an MXFP8 GEMM there dequantizes each operand to bf16
(code times its block's 2^(e - 127), exact in bf16) and multiplies those on bf16 tensor
cores (ops/gemm.py). Where every operand of a layer's GEMMs goes that way, its codes and
scales are never read but by the dequantize kernel; this primitive casts x and writes the
dequantized bf16 values of each usage in its stored layout instead (rowwise [M, K],
columnwise [K, M]): one pass over x and no dequantize pass, the same bits as
`reference.dequantize_data` of the cast's usage, rounded to bf16. Under a sharded jit each
device casts its shard where the shard holds whole 32-element blocks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.core import ShapedArray

from jaxquant.kernels import primitive, sharding
from jaxquant.kernels.config import ELEMENT_CODES
from jaxquant.quantizers import MXFP8Quantizer
from jaxquant.reference import dequantize_data, mxfp8
from jaxquant.tensor import Usage

BLOCK = 32  # MXFP8's block, and the kernel's alignment of both dims


@dataclasses.dataclass(frozen=True)
class ValuesConfig:
  element: str  # "e4m3" or "e5m2"
  rowwise: bool
  columnwise: bool

  @property
  def usages(self) -> tuple[Usage, ...]:
    return tuple(u for u, on in (("rowwise", self.rowwise), ("columnwise", self.columnwise)) if on)

  def ffi_attributes(self) -> dict:
    return {"element": np.int32(ELEMENT_CODES[self.element]), "rowwise": np.int32(self.rowwise),
            "columnwise": np.int32(self.columnwise)}


def _stored(usage: Usage, m: int, k: int) -> tuple[int, int]:
  return (m, k) if usage == "rowwise" else (k, m)


def _abstract_eval(x, *, config: ValuesConfig):
  return [ShapedArray(_stored(u, *x.shape), jnp.bfloat16) for u in config.usages]


def _reference(x, *, config: ValuesConfig):
  fmt = MXFP8Quantizer(config.element).format("rowwise")
  x2d = x.astype(jnp.float32)
  return [dequantize_data(mxfp8.quantize(x2d if u == "rowwise" else x2d.T, fmt)).astype(jnp.bfloat16)
          for u in config.usages]


def _sharding_rule(config: ValuesConfig, shapes, mesh_size):
  m, k = shapes[0]
  if (m // BLOCK) % mesh_size or (k // BLOCK) % mesh_size:
    # Fewer blocks than an even split needs: keep the tensor whole (`_partition` would).
    dims = {"rowwise": ("m", "k"), "columnwise": ("k", "m")}
    return sharding.rule([("m", "k")], [dims[u] for u in config.usages], {},
                         need_replication_factors=("k", "m"))
  M, K = ("mb", "mi"), ("kb", "ki")
  dims = {"rowwise": (M, K), "columnwise": (K, M)}
  sizes = dict(mb=m // BLOCK, mi=BLOCK, kb=k // BLOCK, ki=BLOCK)
  return sharding.rule([(M, K)], [dims[u] for u in config.usages], sizes)


def _partition(config: ValuesConfig, mesh, arg_shapes, result_shape):
  m, k = arg_shapes[0].shape
  m_axes, k_axes = sharding.spec_axes(arg_shapes[0].sharding, 2)
  m_axes = sharding.keep_if_whole(mesh, m_axes, m, BLOCK)
  k_axes = sharding.keep_if_whole(mesh, k_axes, k, BLOCK)
  dims = {"rowwise": (m_axes, k_axes), "columnwise": (k_axes, m_axes)}
  return ([sharding.pspec(m_axes, k_axes)], [sharding.pspec(*dims[u]) for u in config.usages],
          lambda kernel, x: kernel(x))


values_p = primitive.define(primitive.KernelSpec(
    name="jaxquant_mxfp8_values", ffi_target=lambda config: "jaxquant_mxfp8_values",
    abstract_eval=_abstract_eval, reference=_reference, partition=_partition,
    sharding_rule=_sharding_rule))


def unsupported_reason(quantizer, rows: int, cols: int, dtype) -> str | None:
  """Why the values kernel cannot cast an [rows, cols] `dtype` matrix for `quantizer`."""
  if not isinstance(quantizer, MXFP8Quantizer):
    return f"the values kernel casts MXFP8 only, got {quantizer!r}"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
    return f"the values kernel takes bfloat16, float16 or float32 input, got {jnp.dtype(dtype).name}"
  if rows % BLOCK or cols % BLOCK:
    return f"the values kernel needs both dims of the [{rows}, {cols}] matrix divisible by {BLOCK}"
  return None


def mxfp8_values(x2d: jax.Array, quantizer: MXFP8Quantizer, usages) -> dict[Usage, jax.Array]:
  """{usage: the bf16 values of `quantizer`'s cast of x2d [M, K] for that usage, in its
  stored layout}: bit for bit `reference.dequantize_data` of each usage, in bf16."""
  usages = tuple(usages)
  reason = unsupported_reason(quantizer, *jnp.shape(x2d), x2d.dtype) if jnp.ndim(x2d) == 2 else \
      f"the values kernel takes a 2-D matrix, got shape {jnp.shape(x2d)}"
  if reason:
    raise ValueError(f"mxfp8_values: {reason}")
  if not usages or set(usages) - {"rowwise", "columnwise"}:
    raise ValueError(f"mxfp8_values: usages must be among rowwise, columnwise, got {usages}")
  config = ValuesConfig(quantizer.element, "rowwise" in usages, "columnwise" in usages)
  return dict(zip(config.usages, values_p.bind(x2d, config=config)))
