"""What the step benchmark compares: the stock model, jaxquant's presets swapped in, and peers.

A `Variant` is a Linen model with the same param tree as the stock `DecoderStack`, plus how
its train step carries the model's other collections to the next step:

- `bf16`: the stock model. (jaxquant's bf16 preset maps every role to None, so
  `quantize_model(model, recipes.bf16)` runs Flax's own code: the same program.)
- jaxquant presets (`fp8_current`, ..., `hybrid`): `jaxquant.flax.quantize_model` as the
  README says; delayed scaling's "quant_state" is advanced by `update_quant_state`.
- `fp8_current_fast` / `fp8_delayed_fast`: those presets with every GEMM allowed fast
  accumulation (the presets allow it in fprop only), as XLA's FP8 dot, which the peers
  use, accumulates.
- `flax_fp8`: Flax's `Fp8DirectDotGeneralOp` as every projection's `dot_general_cls`
  (pure XLA, delayed scaling, amax history of Flax's default length). Its scales and amax
  histories live in the "_overwrite_with_gradient" collection, whose gradient *is* the
  next step's value (Flax's convention).
- `qwix_fp8_tensor` / `qwix_fp8_channel`: Qwix's quantized training (`QtProvider`), E4M3
  weights and activations, E5M2 gradients, per-tensor or per-channel scales (current
  scaling), on the projections only. Qwix is optional: without it these are skipped.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp
from flax.linen import fp8_ops
from step_model import PROJECTION_PATH_REGEX, DecoderStack

# The `_fast` recipes are the example's (examples/lm/recipes.py), which trains them too.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from lm.recipes import FAST_ACCUMULATION_RECIPES, every_gemm_fast  # noqa: E402

import jaxquant.flax as jqf
from jaxquant import recipes

PEERS = ("flax_fp8", "qwix_fp8_channel", "qwix_fp8_tensor")
PRESETS = tuple(recipes.PRESETS)
# The order variants are compiled and timed in: the baseline, the headline recipe and the
# peers first, so that a run cut short (or one given a deadline) still has the comparisons
# that matter most; the recipes slowest to compile last.
ORDER = (
  "bf16",
  "fp8_current",
  "flax_fp8",
  "qwix_fp8_channel",
  "qwix_fp8_tensor",
  "fp8_delayed",
  "fp8_current_fast",
  "fp8_delayed_fast",
  "fp8_block",
  "mxfp8",
  "nvfp4",
  "hybrid",
)
assert set(ORDER) == set(PRESETS) | set(PEERS) | set(FAST_ACCUMULATION_RECIPES)


def _keep(collections, state_grads):
  return collections


def _overwrite_with_gradient(collections, state_grads):
  return {
    **collections,
    fp8_ops.OVERWRITE_WITH_GRADIENT: state_grads[fp8_ops.OVERWRITE_WITH_GRADIENT],
  }


@dataclasses.dataclass(frozen=True)
class Variant:
  name: str
  model: nn.Module
  # (collections as the forward pass left them, their gradients) -> the next step's.
  advance: Callable[[Any, Any], Any]

  @property
  def is_peer(self) -> bool:
    return self.name in PEERS


def qwix_unavailable_reason() -> str | None:
  try:
    import qwix  # noqa: F401  (optional, benchmark-only)
  except ImportError as error:
    return f"qwix not installed ({error})"
  return None


def _qwix_model(stock: nn.Module, per_channel: bool) -> nn.Module:
  import qwix

  rule = qwix.QtRule(
    module_path=PROJECTION_PATH_REGEX,
    weight_qtype=jnp.float8_e4m3fn,
    act_qtype=jnp.float8_e4m3fn,
    bwd_qtype=jnp.float8_e5m2,
    disable_channelwise_axes=not per_channel,
  )
  return qwix.quantize_model(stock, qwix.QtProvider([rule]))


def build(name: str, stock: DecoderStack) -> Variant:
  """The variant `name` of the stock model (raises ImportError for a missing peer)."""
  if name == "bf16":
    return Variant(name, stock, _keep)
  if name in PRESETS:
    return Variant(name, jqf.quantize_model(stock, recipes.get(name)), jqf.update_quant_state)
  if name in FAST_ACCUMULATION_RECIPES:
    model = jqf.quantize_model(stock, every_gemm_fast(name))
    return Variant(name, model, jqf.update_quant_state)
  if name == "flax_fp8":
    return Variant(
      name, stock.clone(dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp), _overwrite_with_gradient
    )
  if name in ("qwix_fp8_tensor", "qwix_fp8_channel"):
    return Variant(name, _qwix_model(stock, per_channel=name == "qwix_fp8_channel"), _keep)
  raise ValueError(f"unknown variant {name!r}; variants are {list(ORDER)}")
