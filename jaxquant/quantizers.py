"""Immutable quantizer specs: a format and its options, no arrays.

Quantizers are frozen dataclasses, hashable and usable as static arguments under `jit`.
`format(usage)` tells how each usage of a tensor is stored (formats.py); the numerics
behind each option are in NUMERICS.md and `jaxquant.reference`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Literal, Optional, Union

from jaxquant.formats import Family, Format
from jaxquant.tensor import Usage

__all__ = [
  "Float8Quantizer",
  "DelayedFloat8Quantizer",
  "BlockFloat8Quantizer",
  "MXFP8Quantizer",
  "NVFP4Quantizer",
  "HybridQuantizer",
  "BaseQuantizer",
  "Quantizer",
  "Fp8Element",
  "BASE_QUANTIZER_TYPES",
  "QUANTIZER_TYPES",
  "for_usage",
  "needs_state",
  "needs_key",
]

Fp8Element = Literal["e4m3", "e5m2"]
_FP8_ELEMENTS = ("e4m3", "e5m2")
_AMAX_ALGOS = ("max", "most_recent")
_BLOCKS = ("1x128", "128x128")
# The margin divides the scale by 2^margin, which fp32 holds exactly only for these.
_MARGIN_RANGE = (-149, 127)

# Construction-time checks of the options: each error names `Class.field`, the value and
# the rule, a wrong type a TypeError, a value out of range a ValueError. (The options are
# static: a wrong one would otherwise surface inside a trace, or never.)


def _check_choice(quantizer, field: str, choices: tuple[str, ...]) -> None:
  value = getattr(quantizer, field)
  if not isinstance(value, str) or value not in choices:
    error = ValueError if isinstance(value, str) else TypeError
    raise error(f"{type(quantizer).__name__}.{field} must be one of {choices}, got {value!r}")


def _check_bool(quantizer, *fields: str) -> None:
  for field in fields:
    value = getattr(quantizer, field)
    if not isinstance(value, bool):
      raise TypeError(f"{type(quantizer).__name__}.{field} must be a bool, got {value!r}")


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_eps(quantizer) -> None:
  value = quantizer.eps
  rule = f"{type(quantizer).__name__}.eps must be a finite real number >= 0, got {value!r}"
  if not isinstance(value, numbers.Real) or isinstance(value, bool):
    raise TypeError(rule)
  if not (math.isfinite(value) and value >= 0):
    raise ValueError(rule)


@dataclasses.dataclass(frozen=True)
class Float8Quantizer:
  """Per-tensor FP8 with current scaling: the scale comes from this tensor's amax."""

  element: Fp8Element = "e4m3"
  eps: float = 0.0
  pow2_scales: bool = False

  def __post_init__(self):
    _check_choice(self, "element", _FP8_ELEMENTS)
    _check_eps(self)
    _check_bool(self, "pow2_scales")

  def format(self, usage: Usage) -> Format:
    return Format(Family.FP8_TENSOR, self.element)


@dataclasses.dataclass(frozen=True)
class DelayedFloat8Quantizer:
  """Per-tensor FP8 with delayed scaling: the scale comes from an amax history (state)."""

  element: Fp8Element = "e4m3"
  history_len: int = 1024
  margin: int = 0
  amax_algo: Literal["max", "most_recent"] = "max"

  def __post_init__(self):
    _check_choice(self, "element", _FP8_ELEMENTS)
    if not _is_int(self.history_len) or self.history_len < 1:
      error = ValueError if _is_int(self.history_len) else TypeError
      raise error(
        f"DelayedFloat8Quantizer.history_len must be a positive int, got {self.history_len!r}"
      )
    lo, hi = _MARGIN_RANGE
    if not _is_int(self.margin) or not lo <= self.margin <= hi:
      error = ValueError if _is_int(self.margin) else TypeError
      raise error(
        f"DelayedFloat8Quantizer.margin must be an int in [{lo}, {hi}], got {self.margin!r}"
      )
    _check_choice(self, "amax_algo", _AMAX_ALGOS)

  def format(self, usage: Usage) -> Format:
    return Format(Family.FP8_TENSOR, self.element)


@dataclasses.dataclass(frozen=True)
class BlockFloat8Quantizer:
  """DeepSeek-style block FP8: an fp32 scale per 1x128 block or per 128x128 tile.

  1x128 blocks run along the usage's block dim (K rowwise, M columnwise); a 128x128 tile
  scale is shared by both usages. Edge blocks may be partial.
  """

  element: Fp8Element = "e4m3"
  block: Literal["1x128", "128x128"] = "1x128"
  pow2_scales: bool = True
  eps: float = 0.0

  def __post_init__(self):
    _check_choice(self, "element", _FP8_ELEMENTS)
    _check_choice(self, "block", _BLOCKS)
    _check_bool(self, "pow2_scales")
    _check_eps(self)

  def format(self, usage: Usage) -> Format:
    shape = (1, 128) if self.block == "1x128" else (128, 128)
    return Format(
      Family.FP8_BLOCK, self.element, shape, partial_blocks=True, pow2_scales=self.pow2_scales
    )


@dataclasses.dataclass(frozen=True)
class MXFP8Quantizer:
  """OCP MXFP8: E8M0 scale per 32 elements, NVIDIA's round-the-scale-up rule."""

  element: Fp8Element = "e4m3"

  def __post_init__(self):
    _check_choice(self, "element", _FP8_ELEMENTS)

  def format(self, usage: Usage) -> Format:
    return Format(Family.MXFP8, self.element, (1, 32))


@dataclasses.dataclass(frozen=True)
class NVFP4Quantizer:
  """NVFP4: E2M1 data, E4M3 scale per 16 elements (or 16x16 tile), fp32 global amax.

  Attributes:
    tile_2d: one scale per 16x16 tile shared by both usages (weights).
    rht: random Hadamard transform on the columnwise usage (wgrad operands).
    stochastic_rounding: round data stochastically (needs a PRNG key).
    per_token: one global amax per row of the rowwise usage; the columnwise usage
      keeps a per-tensor amax.
  """

  tile_2d: bool = False
  rht: bool = False
  stochastic_rounding: bool = False
  per_token: bool = False

  def __post_init__(self):
    _check_bool(self, "tile_2d", "rht", "stochastic_rounding", "per_token")
    if self.tile_2d and self.per_token:
      raise ValueError("NVFP4Quantizer: per_token row scales need 1-D blocks, not tile_2d")
    if self.tile_2d and self.rht:
      raise ValueError(
        "NVFP4Quantizer: tile_2d usages are exact transposes sharing tile "
        "scales, which the RHT of the columnwise usage would break"
      )

  def format(self, usage: Usage) -> Format:
    block = (16, 16) if self.tile_2d else (1, 16)
    return Format(Family.NVFP4, "e2m1", block, row_scaled=self.per_token and usage == "rowwise")


BaseQuantizer = Union[
  Float8Quantizer, DelayedFloat8Quantizer, BlockFloat8Quantizer, MXFP8Quantizer, NVFP4Quantizer
]
BASE_QUANTIZER_TYPES = (
  Float8Quantizer,
  DelayedFloat8Quantizer,
  BlockFloat8Quantizer,
  MXFP8Quantizer,
  NVFP4Quantizer,
)


@dataclasses.dataclass(frozen=True)
class HybridQuantizer:
  """Different formats for the two usages of one tensor, each from the original values.

  Either side may be `None`: that usage stays in high precision.
  """

  rowwise: Optional[BaseQuantizer]
  columnwise: Optional[BaseQuantizer]

  def __post_init__(self):
    for side in ("rowwise", "columnwise"):
      q = getattr(self, side)
      if q is not None and not isinstance(q, BASE_QUANTIZER_TYPES):
        raise TypeError(f"HybridQuantizer.{side} must be a base quantizer or None, got {q!r}")
    if isinstance(self.columnwise, NVFP4Quantizer) and self.columnwise.per_token:
      raise ValueError(
        "HybridQuantizer: per_token (row-scaled) NVFP4 is only allowed for the rowwise "
        "usage; its rows are the columnwise usage's contraction dim"
      )

  def for_usage(self, usage: Usage) -> Optional[BaseQuantizer]:
    return self.rowwise if usage == "rowwise" else self.columnwise


Quantizer = Union[BaseQuantizer, HybridQuantizer]
QUANTIZER_TYPES = BASE_QUANTIZER_TYPES + (HybridQuantizer,)


def for_usage(quantizer: Optional[Quantizer], usage: Usage) -> Optional[BaseQuantizer]:
  """The base quantizer a usage is produced with (None: high precision)."""
  if isinstance(quantizer, HybridQuantizer):
    return quantizer.for_usage(usage)
  return quantizer


def needs_state(quantizer: Optional[Quantizer]) -> bool:
  """Whether quantizing with this quantizer needs delayed-scaling state."""
  return any(
    isinstance(for_usage(quantizer, u), DelayedFloat8Quantizer) for u in ("rowwise", "columnwise")
  )


def needs_key(quantizer: Optional[Quantizer]) -> bool:
  """Whether quantizing with this quantizer needs a PRNG key (stochastic rounding)."""
  return any(
    isinstance(q := for_usage(quantizer, u), NVFP4Quantizer) and q.stochastic_rounding
    for u in ("rowwise", "columnwise")
  )
