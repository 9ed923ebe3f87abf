"""Recipe names -> the model each recipe trains.

This is the example's one quantization seam: 'bf16' trains the plain model; every other
name hands the plain model and a jaxquant recipe to `jaxquant.flax.quantize_model`, which
swaps its nn.Dense layers for quantized ones with the same parameters. What the train
step must do beyond the plain model's (advance delayed-scaling state, feed stochastic
rounding a key) comes back with it in a `RecipeModel`, so training.py knows no recipe.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Optional

import flax.linen as nn

PLAIN_RECIPE = "bf16"
# Presets of jaxquant.recipes, by the same name.
PRESET_RECIPES = ("fp8_current", "fp8_delayed", "fp8_block", "mxfp8", "nvfp4", "hybrid")
# A per-role policy written here with CustomRecipe: nvfp4_with_bf16_tail below.
CUSTOM_RECIPE = "custom"
RECIPE_NAMES = (PLAIN_RECIPE,) + PRESET_RECIPES + (CUSTOM_RECIPE,)

# NVIDIA's NVFP4 pretraining recipe keeps roughly the last 15% of the blocks in bf16:
# the final layers are the most sensitive to quantization noise.
BF16_TAIL_FRACTION = 0.15

# (collections after the forward pass, gradients of the loss w.r.t. the collections the
# step started from) -> the collections for the next step.
StateAdvance = Callable[[dict, dict], dict]


@dataclasses.dataclass(frozen=True)
class RecipeModel:
  """What a train step needs to train a model under one recipe."""

  module: nn.Module
  advance_state: StateAdvance
  rng_streams: tuple[str, ...]  # named RNG streams apply() gets a fresh key for each step


def keep_forward_state(forward_collections: dict, collection_grads: dict) -> dict:
  return forward_collections


def parse_recipe_names(text: str) -> list[str]:
  """'all' or a comma-separated list of names from RECIPE_NAMES."""
  names = list(RECIPE_NAMES) if text == "all" else [n.strip() for n in text.split(",") if n.strip()]
  unknown = [n for n in names if n not in RECIPE_NAMES]
  if unknown or not names:
    raise ValueError(f"unknown recipe(s) {unknown or text!r}; choose from {', '.join(RECIPE_NAMES)} or 'all'")
  return names


def layer_index(module_path: str) -> Optional[int]:
  """3 for 'decoder/layer_3/mlp/wi'; None for modules outside the decoder layers (the head)."""
  match = re.search(r"(?:^|/)layer_(\d+)(?:/|$)", module_path)
  return int(match.group(1)) if match else None


def nvfp4_with_bf16_tail(n_layers: int, nvfp4_factory: Callable[[Any], Any]) -> Callable[[Any], Any]:
  """A per-role policy after NVIDIA's NVFP4 recipe: NVFP4 GEMMs, the last layers in bf16.

  Roles in the last BF16_TAIL_FRACTION of the decoder layers (at least one) and outside
  them (the output head) get None, i.e. bf16; every other role gets nvfp4_factory's
  quantizer.
  """
  first_bf16_layer = n_layers - max(1, round(BF16_TAIL_FRACTION * n_layers))

  def qfactory(role):
    layer = layer_index(role.name)
    if layer is None or layer >= first_bf16_layer:
      return None
    return nvfp4_factory(role)

  return qfactory


def model_for_recipe(plain_model: nn.Module, name: str, n_layers: int) -> RecipeModel:
  """The model that trains under recipe `name`; raises early, naming what is missing."""
  if name == PLAIN_RECIPE:
    return RecipeModel(plain_model, keep_forward_state, rng_streams=())
  try:
    from jaxquant import recipes as jaxquant_recipes
    from jaxquant.flax import quantize_model, update_quant_state
    from jaxquant.flax.linen import QUANT_RNG
  except ImportError as error:
    raise RuntimeError(
        f"recipe {name!r} needs jaxquant.flax.quantize_model and jaxquant.recipes, which this "
        f"jaxquant install does not provide ({error}). Run with --recipes {PLAIN_RECIPE} meanwhile."
    ) from error
  if name == CUSTOM_RECIPE:
    recipe = jaxquant_recipes.CustomRecipe(
        nvfp4_with_bf16_tail(n_layers, jaxquant_recipes.nvfp4_factory), name=CUSTOM_RECIPE)
  else:
    recipe = jaxquant_recipes.get(name)
  return RecipeModel(quantize_model(plain_model, recipe), update_quant_state,
                     rng_streams=(QUANT_RNG,))
