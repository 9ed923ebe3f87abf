"""Recipes: maps from a QuantizerRole to a quantizer, or None for high precision.

`CustomRecipe(qfactory)` wraps any callable; every preset below is such a factory, so
each doubles as an example of writing one. `autocast(recipe)` sets a default recipe for
the code inside it; a recipe passed to a module or op explicitly always wins.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Callable, Literal, Optional, Union

from jaxquant.quantizers import (
  QUANTIZER_TYPES,
  BlockFloat8Quantizer,
  DelayedFloat8Quantizer,
  Float8Quantizer,
  HybridQuantizer,
  MXFP8Quantizer,
  NVFP4Quantizer,
  Quantizer,
)
from jaxquant.roles import TENSOR_TYPES, QuantizerRole

__all__ = [
  "CustomRecipe",
  "QFactory",
  "BackwardMode",
  "BACKWARD_MODES",
  "GEMMS",
  "FP8_FAST_ACCUMULATION",
  "PRESETS",
  "bf16",
  "fp8_current",
  "fp8_delayed",
  "fp8_block",
  "mxfp8",
  "nvfp4",
  "hybrid",
  "bf16_factory",
  "fp8_current_factory",
  "fp8_delayed_factory",
  "fp8_block_factory",
  "mxfp8_factory",
  "nvfp4_factory",
  "hybrid_factory",
  "get",
  "autocast",
  "resolve",
]

QFactory = Callable[[QuantizerRole], Optional[Quantizer]]
# How the two backward GEMMs (dgrad, wgrad) take their operands:
#   "quantized": each operand quantized for the usage its GEMM needs (the default);
#   "high_precision": the original high-precision operands;
#   "dequantized": the dequantized forward (rowwise) values of x and w, and dy as is.
BackwardMode = Literal["quantized", "high_precision", "dequantized"]
BACKWARD_MODES = ("quantized", "high_precision", "dequantized")
# The three GEMMs of a linear layer (ops/_dense_vjp.py): y = x·wᵀ, dx = dy·w, dw = xᵀ·dy.
GEMMS = ("fprop", "dgrad", "wgrad")


def check_fast_accumulation(gemms, what: str) -> frozenset:
  """The GEMM names of a `fast_accumulation` argument as a frozenset; a TypeError for
  anything but a collection of names, a ValueError naming the unknown ones."""
  rule = f"{what}: fast_accumulation takes a collection of GEMM names among {GEMMS}"
  if isinstance(gemms, str):
    raise TypeError(f"{rule}, got the string {gemms!r}; write ({gemms!r},)")
  try:
    names = frozenset(gemms)
  except TypeError:  # not iterable, or unhashable members
    raise TypeError(f"{rule}, got {gemms!r}") from None
  unknown = sorted(names - set(GEMMS), key=repr)
  if unknown:
    raise ValueError(
      f"{what}: fast_accumulation names unknown GEMMs {unknown}; the GEMMs are {GEMMS}"
    )
  return names


@dataclasses.dataclass(frozen=True)
class CustomRecipe:
  """A recipe from a user callback `qfactory(role) -> quantizer | None`.

  `fast_accumulation` names the GEMMs ("fprop", "dgrad", "wgrad") whose per-tensor FP8
  kernel may skip promoting the tensor cores' partial sums to fp32 along k (cuBLASLt's
  FAST_ACCUM; faster, less accurate for long k: docs/numerics.md). GEMMs of other formats
  have no such mode and accumulate as always; the reference's sums are exact either way.

  `tiny_gemms_in_high_precision` (every preset sets it; False by default): the Flax layers
  and the swap-in run a *tiny* weight GEMM as written, in high precision, instead of
  refusing it as unfit (or following `quantize_model`'s `on_unfit`), and `swap_report`
  says why ("high precision: N=4 is smaller than one block (32) of mxfp8"). A GEMM is
  tiny when its K or N (the weight's dims, the same at every call: never M, the tokens,
  so a layer does not change format between training and few-token inference) is
  smaller than one block that a quantizer applies along that dim, in a usage its GEMMs
  consume (the backward's too, per `backward`): an MoE router of 4 experts under MXFP8
  (blocks of 32), NVFP4 (16). Formats whose edge blocks may be partial (block FP8) and
  per-tensor FP8 tile every shape, so nothing is tiny for them: every GEMM that fits
  runs as it did.
  """

  qfactory: QFactory
  backward: BackwardMode = "quantized"
  name: str = "custom"
  fast_accumulation: frozenset = frozenset()
  tiny_gemms_in_high_precision: bool = False

  def __post_init__(self):
    if not callable(self.qfactory):
      raise TypeError(f"CustomRecipe needs a callable qfactory, got {self.qfactory!r}")
    if not isinstance(self.backward, str) or self.backward not in BACKWARD_MODES:
      error = ValueError if isinstance(self.backward, str) else TypeError
      raise error(f"CustomRecipe.backward must be one of {BACKWARD_MODES}, got {self.backward!r}")
    if not isinstance(self.name, str):
      raise TypeError(f"CustomRecipe.name must be a str, got {self.name!r}")
    object.__setattr__(
      self, "fast_accumulation", check_fast_accumulation(self.fast_accumulation, "CustomRecipe")
    )
    if not isinstance(self.tiny_gemms_in_high_precision, bool):
      raise TypeError(
        "CustomRecipe.tiny_gemms_in_high_precision must be a bool, got "
        f"{self.tiny_gemms_in_high_precision!r}"
      )

  def quantizer(self, role: QuantizerRole) -> Optional[Quantizer]:
    q = self.qfactory(role)
    if q is not None and not isinstance(q, QUANTIZER_TYPES):
      raise TypeError(
        f"recipe {self.name!r} returned {q!r} for role {role}: a qfactory must "
        "return a jaxquant quantizer or None"
      )
    return q

  def quantizers(self, module_type: str, name: str) -> dict[str, Optional[Quantizer]]:
    """The quantizer of each tensor type of one GEMM module."""
    return {t: self.quantizer(QuantizerRole(module_type, t, name)) for t in TENSOR_TYPES}


# ---- Presets, each a plain factory. ----


def bf16_factory(role: QuantizerRole):
  return None


def fp8_current_factory(role: QuantizerRole):
  """E4M3 forward, E5M2 gradients (their range matters more than their precision)."""
  return Float8Quantizer("e5m2" if role.tensor_type == "grad_output" else "e4m3")


def fp8_delayed_factory(role: QuantizerRole):
  return DelayedFloat8Quantizer("e5m2" if role.tensor_type == "grad_output" else "e4m3")


def fp8_block_factory(role: QuantizerRole):
  """DeepSeek-V3: 1x128 blocks for activations and gradients, 128x128 tiles for weights."""
  return BlockFloat8Quantizer(block="128x128" if role.tensor_type == "weight" else "1x128")


def mxfp8_factory(role: QuantizerRole):
  return MXFP8Quantizer("e4m3")


def nvfp4_factory(role: QuantizerRole):
  """NVIDIA's NVFP4 recipe: 16x16 weight tiles, RHT on both wgrad operands, SR on gradients."""
  if role.tensor_type == "weight":
    return NVFP4Quantizer(tile_2d=True)
  if role.tensor_type == "grad_output":
    return NVFP4Quantizer(rht=True, stochastic_rounding=True)
  return NVFP4Quantizer(rht=True)


def hybrid_factory(role: QuantizerRole):
  """MXFP8 for the forward (rowwise) usages, NVFP4 for the columnwise ones."""
  columnwise = nvfp4_factory(role)
  if role.tensor_type == "weight":
    columnwise = NVFP4Quantizer()  # tiles are shared between usages; here only one is NVFP4
  return HybridQuantizer(rowwise=MXFP8Quantizer("e4m3"), columnwise=columnwise)


# The per-tensor FP8 presets accumulate the forward GEMM fast, as TransformerEngine's FP8
# recipes do; the backward GEMMs promote along k (wgrad's k is the batch's tokens, the
# longest sum, and its sums feed the weights). (XLA's own FP8 dot, which Flax's and Qwix's
# FP8 training use, accumulates every GEMM fast: `dataclasses.replace(recipe,
# fast_accumulation=GEMMS)` does the same here.)
FP8_FAST_ACCUMULATION = frozenset({"fprop"})

# The presets keep tiny GEMMs (an MoE router of a few experts) in high precision.
_PRESET = dict(tiny_gemms_in_high_precision=True)
bf16 = CustomRecipe(bf16_factory, name="bf16", **_PRESET)
fp8_current = CustomRecipe(
  fp8_current_factory, name="fp8_current", fast_accumulation=FP8_FAST_ACCUMULATION, **_PRESET
)
fp8_delayed = CustomRecipe(
  fp8_delayed_factory, name="fp8_delayed", fast_accumulation=FP8_FAST_ACCUMULATION, **_PRESET
)
fp8_block = CustomRecipe(fp8_block_factory, name="fp8_block", **_PRESET)
mxfp8 = CustomRecipe(mxfp8_factory, name="mxfp8", **_PRESET)
nvfp4 = CustomRecipe(nvfp4_factory, name="nvfp4", **_PRESET)
hybrid = CustomRecipe(hybrid_factory, name="hybrid", **_PRESET)

PRESETS = {r.name: r for r in (bf16, fp8_current, fp8_delayed, fp8_block, mxfp8, nvfp4, hybrid)}


def get(name: str) -> CustomRecipe:
  """A preset recipe by name."""
  try:
    return PRESETS[name]
  except KeyError:
    raise ValueError(f"unknown recipe {name!r}; presets are {sorted(PRESETS)}") from None


# ---- autocast: the one piece of context, a contextvar (no global mutable state). ----

_AUTOCAST: contextvars.ContextVar[Optional[CustomRecipe]] = contextvars.ContextVar(
  "jaxquant_autocast", default=None
)


def _as_recipe(recipe: Union[CustomRecipe, str]) -> CustomRecipe:
  """A recipe, or a preset's name (`get`) as its recipe."""
  if isinstance(recipe, CustomRecipe):
    return recipe
  if isinstance(recipe, str):
    return get(recipe)
  raise TypeError(
    f"recipe must be a CustomRecipe or a preset name (one of {sorted(PRESETS)}), "
    f"got {recipe!r} ({type(recipe).__name__})"
  )


@contextlib.contextmanager
def autocast(recipe: Optional[Union[CustomRecipe, str]]):
  """Within this block, modules and ops without an explicit recipe use `recipe` (a recipe or
  a preset name; None: no default, as outside every autocast)."""
  recipe = None if recipe is None else _as_recipe(recipe)
  token = _AUTOCAST.set(recipe)
  try:
    yield recipe
  finally:
    _AUTOCAST.reset(token)


def resolve(*candidates: Optional[Union[CustomRecipe, str]]) -> CustomRecipe:
  """The most specific recipe: the first non-None candidate (a recipe, or a preset name),
  then autocast's, then bf16. Anything else is a TypeError naming it."""
  for r in candidates:
    if r is not None:
      return _as_recipe(r)
  return _AUTOCAST.get() or bf16
