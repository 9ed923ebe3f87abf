"""MXFP8 and NVFP4 quantized straight to the values a GEMM multiplies, by a kernel.

Hopper has no MXFP8 or NVFP4 tensor cores: a GEMM of either there dequantizes each
operand to bf16 (the codes times their block scales, exact in bf16) and multiplies those
on bf16 tensor cores (ops/_gemm.py), NVFP4's global decode scales S_dec applied to the
sums. Where every operand of a layer's GEMMs goes that way, its codes and scales are
never read but by the dequantize kernel; these primitives cast x and write the
dequantized bf16 values of each usage in its stored layout instead (rowwise [M, K],
columnwise [K, M]): one pass over x and no dequantize pass, the same bits as the dequantize
kernel's block-scaled values of the cast's usage (`reference.dequantize_data` for MXFP8,
`reference.nvfp4.dequantize_values` for NVFP4), rounded to bf16. An NVFP4 usage comes
with the global amax its S_dec is taken from (`ScaledValues`). Under a sharded jit each
device casts its shard where the shard holds whole blocks.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jaxquant.kernels import _cast as cast
from jaxquant.kernels import _primitive as primitive
from jaxquant.kernels import _sharding as sharding
from jaxquant.kernels._config import ELEMENT_CODES, CastConfig, cast_config
from jaxquant.kernels._quantize import cast_seed, nvfp4_amaxes
from jaxquant.kernels._reference_cast import reference_cast
from jaxquant.quantizers import MXFP8Quantizer, NVFP4Quantizer
from jaxquant.reference import _mxfp8 as mxfp8
from jaxquant.reference import _nvfp4 as nvfp4
from jaxquant.reference import dequantize_data
from jaxquant.tensor import QuantizedData, Usage

BLOCK = 32  # MXFP8's block, and the kernel's alignment of both dims
NVFP4_BLOCK = 16  # NVFP4's block (and 16x16 tile), the NVFP4 kernel's alignment


class ScaledValues(NamedTuple):
  """An NVFP4 usage as a GEMM that dequantizes first takes it: the block-scaled values in
  bf16, in the usage's stored layout, and the global amax (fp32 ()) whose S_dec scales
  the GEMM's sums."""

  values: jax.Array
  amax: jax.Array


@dataclasses.dataclass(frozen=True)
class ValuesConfig:
  element: str  # "e4m3" or "e5m2"
  rowwise: bool
  columnwise: bool

  @property
  def usages(self) -> tuple[Usage, ...]:
    return tuple(u for u, on in (("rowwise", self.rowwise), ("columnwise", self.columnwise)) if on)

  def ffi_attributes(self) -> dict:
    return {
      "element": np.int32(ELEMENT_CODES[self.element]),
      "rowwise": np.int32(self.rowwise),
      "columnwise": np.int32(self.columnwise),
    }


def _stored(usage: Usage, m: int, k: int) -> tuple[int, int]:
  return (m, k) if usage == "rowwise" else (k, m)


def _abstract_eval(x, *, config: ValuesConfig):
  return [ShapedArray(_stored(u, *x.shape), jnp.bfloat16) for u in config.usages]


def _reference(x, *, config: ValuesConfig):
  fmt = MXFP8Quantizer(config.element).format("rowwise")
  x2d = x.astype(jnp.float32)
  return [
    dequantize_data(mxfp8.quantize(x2d if u == "rowwise" else x2d.T, fmt)).astype(jnp.bfloat16)
    for u in config.usages
  ]


def _values_rule(
  usages,
  m: int,
  k: int,
  block: int,
  mesh_size: int,
  more_operands=lambda M: [],
  replicated: tuple = (),
):
  """The Shardy rule of a values cast: x [M, K] (then `more_operands(M)`) to each usage's
  values in its stored layout, M and K split only into whole blocks."""
  whole = (m // block) % mesh_size or (k // block) % mesh_size
  # Fewer blocks than an even split needs: keep the tensor whole (the partitions would).
  M, K = ("m", "k") if whole else (("mb", "mi"), ("kb", "ki"))
  dims = {"rowwise": (M, K), "columnwise": (K, M)}
  operands, results = [(M, K), *more_operands(M)], [dims[u] for u in usages]
  if whole:
    return sharding.rule(operands, results, {}, need_replication_factors=("k", "m") + replicated)
  sizes = dict(mb=m // block, mi=block, kb=k // block, ki=block)
  return sharding.rule(operands, results, sizes, need_replication_factors=replicated)


def _sharding_rule(config: ValuesConfig, shapes, mesh_size):
  return _values_rule(config.usages, *shapes[0], BLOCK, mesh_size)


def _partition(config: ValuesConfig, mesh, arg_shapes, result_shape):
  m, k = arg_shapes[0].shape
  m_axes, k_axes = sharding.spec_axes(arg_shapes[0].sharding, 2)
  m_axes = sharding.keep_if_whole(mesh, m_axes, m, BLOCK)
  k_axes = sharding.keep_if_whole(mesh, k_axes, k, BLOCK)
  dims = {"rowwise": (m_axes, k_axes), "columnwise": (k_axes, m_axes)}
  return (
    [sharding.pspec(m_axes, k_axes)],
    [sharding.pspec(*dims[u]) for u in config.usages],
    lambda kernel, x: kernel(x),
  )


MXFP8_VALUES_SPEC = primitive.KernelSpec(
  name="jaxquant_mxfp8_values",
  abstract_eval=_abstract_eval,
  reference=_reference,
  partition=_partition,
  sharding_rule=_sharding_rule,
)
values_p = primitive.define(MXFP8_VALUES_SPEC)


def unsupported_reason(quantizer, rows: int, cols: int, dtype) -> str | None:
  """Why the values kernel cannot cast an [rows, cols] `dtype` matrix for `quantizer`."""
  if not isinstance(quantizer, MXFP8Quantizer):
    return f"the values kernel casts MXFP8 only, got {quantizer!r}"
  if jnp.dtype(dtype) not in (
    jnp.dtype(jnp.float32),
    jnp.dtype(jnp.float16),
    jnp.dtype(jnp.bfloat16),
  ):
    return (
      f"the values kernel takes bfloat16, float16 or float32 input, got {jnp.dtype(dtype).name}"
    )
  if rows % BLOCK or cols % BLOCK:
    return f"the values kernel needs both dims of the [{rows}, {cols}] matrix divisible by {BLOCK}"
  return None


def mxfp8_values(x2d: jax.Array, quantizer: MXFP8Quantizer, usages) -> dict[Usage, jax.Array]:
  """{usage: the bf16 values of `quantizer`'s cast of x2d [M, K] for that usage, in its
  stored layout}: bit for bit `reference.dequantize_data` of each usage, in bf16."""
  usages = tuple(usages)
  reason = (
    unsupported_reason(quantizer, *jnp.shape(x2d), x2d.dtype)
    if jnp.ndim(x2d) == 2
    else f"the values kernel takes a 2-D matrix, got shape {jnp.shape(x2d)}"
  )
  if reason:
    raise ValueError(f"mxfp8_values: {reason}")
  if not usages or set(usages) - {"rowwise", "columnwise"}:
    raise ValueError(f"mxfp8_values: usages must be among rowwise, columnwise, got {usages}")
  config = ValuesConfig(quantizer.element, "rowwise" in usages, "columnwise" in usages)
  return dict(zip(config.usages, values_p.bind(x2d, config=config), strict=False))


# ---- NVFP4 ----


def _nvfp4_abstract_eval(x, row_amax, col_amax, seed, *, config: CastConfig):
  return [ShapedArray(_stored(u, *x.shape), jnp.bfloat16) for u in config.usages]


def _nvfp4_reference(x, row_amax, col_amax, seed, *, config: CastConfig):
  """The cast's reference, each usage's codes times their block scales, in bf16."""
  outs = reference_cast(x, row_amax, col_amax, seed, config=config)
  values = []
  for i, usage in enumerate(config.usages):
    amax = row_amax if usage == "rowwise" else col_amax
    qd = QuantizedData(outs[2 * i], outs[2 * i + 1], amax, config.usage_format(usage))
    values.append(nvfp4.dequantize_values(qd).astype(jnp.bfloat16))
  return values


def _nvfp4_sharding_rule(config: CastConfig, shapes, mesh_size):
  # The row amax ([M] per token, else a scalar), the column amax, the seed (replicated).
  seed = ("seed",) if config.stochastic_rounding else ()
  more = lambda M: [(M,) if config.format.row_scaled else (), (), seed]
  return _values_rule(config.usages, *shapes[0], NVFP4_BLOCK, mesh_size, more, seed)


def _nvfp4_partition(config: CastConfig, mesh, arg_shapes, result_shape):
  # The cast's partitioning (whole blocks per shard, a random stream per shard), with one
  # result per usage: the values take their codes' specs.
  arg_specs, cast_specs, local = cast.partition(config, mesh, arg_shapes, result_shape)
  return arg_specs, cast_specs[::2], local


NVFP4_VALUES_SPEC = primitive.KernelSpec(
  name="jaxquant_nvfp4_values",
  abstract_eval=_nvfp4_abstract_eval,
  reference=_nvfp4_reference,
  partition=_nvfp4_partition,
  sharding_rule=_nvfp4_sharding_rule,
)
nvfp4_values_p = primitive.define(NVFP4_VALUES_SPEC)


def nvfp4_unsupported_reason(quantizer, rows: int, cols: int, dtype) -> Optional[str]:
  """Why the NVFP4 values kernel cannot cast an [rows, cols] `dtype` matrix for `quantizer`."""
  if not isinstance(quantizer, NVFP4Quantizer):
    return f"the NVFP4 values kernel casts NVFP4 only, got {quantizer!r}"
  if quantizer.per_token:
    return "the NVFP4 values kernel takes per-tensor global amaxes, not per_token rows"
  if jnp.dtype(dtype) not in (
    jnp.dtype(jnp.float32),
    jnp.dtype(jnp.float16),
    jnp.dtype(jnp.bfloat16),
  ):
    return (
      f"the values kernel takes bfloat16, float16 or float32 input, got {jnp.dtype(dtype).name}"
    )
  if rows % NVFP4_BLOCK or cols % NVFP4_BLOCK:
    return (
      f"the NVFP4 values kernel needs both dims of the [{rows}, {cols}] matrix divisible "
      f"by {NVFP4_BLOCK}"
    )
  return None


def nvfp4_values(
  x2d: jax.Array, quantizer: NVFP4Quantizer, usages, *, key: Optional[jax.Array] = None
) -> dict[Usage, ScaledValues]:
  """{usage: ScaledValues of `quantizer`'s cast of x2d [M, K] for that usage}: the values
  bit for bit the dequantize kernel's block-scaled ones of the cast (its global amaxes
  taken as the cast takes them), in bf16; `key` for stochastic rounding."""
  usages = tuple(usages)
  reason = (
    nvfp4_unsupported_reason(quantizer, *jnp.shape(x2d), x2d.dtype)
    if jnp.ndim(x2d) == 2
    else f"the values kernel takes a 2-D matrix, got shape {jnp.shape(x2d)}"
  )
  if reason:
    raise ValueError(f"nvfp4_values: {reason}")
  if not usages or set(usages) - {"rowwise", "columnwise"}:
    raise ValueError(f"nvfp4_values: usages must be among rowwise, columnwise, got {usages}")
  config = cast_config(quantizer, usages)
  if config.stochastic_rounding and key is None:
    raise ValueError(f"nvfp4_values: {quantizer!r} rounds stochastically: pass a PRNG key as key=")
  row_amax, col_amax = nvfp4_amaxes(x2d, quantizer, usages)
  values = nvfp4_values_p.bind(x2d, row_amax, col_amax, cast_seed(config, key), config=config)
  amaxes = {"rowwise": row_amax, "columnwise": col_amax}
  return {u: ScaledValues(v, amaxes[u]) for u, v in zip(config.usages, values, strict=False)}
