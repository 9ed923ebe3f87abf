"""The cast kernels' static options, as one frozen config, and the codes formats travel as.

`CastConfig` is hashable (a primitive parameter) and turns into the FFI attributes that
ffi/include/jaxquant/bindings.h decodes into the C++ struct of the same name: every
field, every call, so the two sides cannot drift apart silently (XLA rejects a call whose
attribute set differs from the struct's; tests/kernels/test_ffi_bindings.py compares them).
The other kernels' configs live with their kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from jaxquant.formats import Family, Format
from jaxquant.quantizers import BaseQuantizer, DelayedFloat8Quantizer, NVFP4Quantizer
from jaxquant.tensor import Usage

# The codes of ffi_glue.h's Family and Element enums.
FAMILY_CODES = {Family.FP8_TENSOR: 0, Family.FP8_BLOCK: 1, Family.MXFP8: 2, Family.NVFP4: 3}
ELEMENT_CODES = {"e4m3": 0, "e5m2": 1, "e2m1": 2}


def format_attributes(fmt: Format) -> dict:
  """The FFI attributes that say a format, in the cast's and the dequantize's configs."""
  i32 = np.int32
  return dict(
    family=i32(FAMILY_CODES[fmt.family]),
    element=i32(ELEMENT_CODES[fmt.element]),
    block_rows=i32(fmt.block[0]),
    block_cols=i32(fmt.block[1]),
    row_scaled=i32(fmt.row_scaled),
  )


@dataclasses.dataclass(frozen=True)
class CastConfig:
  """What one cast computes (every cast family, and the NVFP4 values cast).

  `format` is the rowwise format of the quantizer; the columnwise usage of the same
  quantizer differs only where NUMERICS.md says so (no row scales; RHT when `rht`).
  """

  format: Format
  rowwise: bool = True
  columnwise: bool = False
  pow2_scales: bool = False
  eps: float = 0.0
  given_scale: bool = False  # FP8 per-tensor: the scalar input is the (delayed) scale
  rht: bool = False  # NVFP4: Hadamard transform on the columnwise usage
  stochastic_rounding: bool = False
  # Per-tensor FP8 only: one more result, the input's amax, taken as the cast reads it
  # (delayed scaling records it; current scaling needs it before the cast).
  observe_amax: bool = False

  def ffi_attributes(self) -> dict:
    i32 = np.int32
    return dict(
      **format_attributes(self.format),
      rowwise=i32(self.rowwise),
      columnwise=i32(self.columnwise),
      pow2_scales=i32(self.pow2_scales),
      eps=np.float32(self.eps),
      given_scale=i32(self.given_scale),
      rht=i32(self.rht),
      stochastic_rounding=i32(self.stochastic_rounding),
      observe_amax=i32(self.observe_amax),
    )

  @property
  def usages(self) -> tuple[Usage, ...]:
    return tuple(u for u, on in (("rowwise", self.rowwise), ("columnwise", self.columnwise)) if on)

  def usage_format(self, usage: Usage) -> Format:
    if usage == "columnwise" and self.format.row_scaled:
      return dataclasses.replace(self.format, row_scaled=False)
    return self.format


def cast_config(quantizer: BaseQuantizer, usages: tuple[Usage, ...]) -> CastConfig:
  """The cast config of a base quantizer producing `usages` in one pass."""
  # Row scales (per-token) belong to the rowwise usage only.
  fmt = quantizer.format("rowwise" if "rowwise" in usages else "columnwise")
  return CastConfig(
    format=fmt,
    rowwise="rowwise" in usages,
    columnwise="columnwise" in usages,
    pow2_scales=bool(getattr(quantizer, "pow2_scales", False)),
    eps=float(getattr(quantizer, "eps", 0.0)),
    given_scale=isinstance(quantizer, DelayedFloat8Quantizer),
    observe_amax=isinstance(quantizer, DelayedFloat8Quantizer),
    rht=isinstance(quantizer, NVFP4Quantizer) and quantizer.rht and "columnwise" in usages,
    stochastic_rounding=isinstance(quantizer, NVFP4Quantizer) and quantizer.stochastic_rounding,
  )


def unsupported_reason(quantizer: BaseQuantizer, rows: int, cols: int, dtype) -> Optional[str]:
  """Why no kernel handles this quantizer on an [rows, cols] `dtype` matrix, or None.

  The formats' own divisibility rules are checked before this (formats.Format.check_dims);
  these are the kernels' extra limits, each a case the reference still serves.
  """
  if np.dtype(dtype) not in (np.dtype("float32"), np.dtype("float16"), np.dtype("bfloat16")):
    return f"kernels take bfloat16, float16 or float32 input, got {np.dtype(dtype)}"
  if isinstance(quantizer, NVFP4Quantizer) and quantizer.tile_2d and quantizer.rht:
    return "NVFP4 16x16 tiles with RHT are not implemented in the kernel"
  multiple = 32 if quantizer.format("rowwise").family is Family.MXFP8 else 16
  if rows % multiple or cols % multiple:
    return (
      f"the {type(quantizer).__name__} kernel needs both dims of the [M, K] = "
      f"[{rows}, {cols}] matrix divisible by {multiple}"
    )
  return None
