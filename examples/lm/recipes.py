"""Recipe names -> the model each recipe trains.

This is the example's one quantization seam: 'bf16' trains the plain model; every other
name hands the plain model and a jaxquant recipe to `jaxquant.flax.quantize_model`, which
swaps its nn.Dense layers for quantized ones. Any state those layers keep (delayed
scaling's amax history and scales, in the 'quant_state' collection) is threaded by the
train step like any other non-parameter collection.
"""

from __future__ import annotations

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


def nvfp4_with_bf16_tail(n_layers: int) -> Callable[[Any], Any]:
  """A per-role policy after NVIDIA's NVFP4 recipe: NVFP4 GEMMs, the last layers in bf16.

  Weights use 16x16 tiles (one scale shared by fprop and dgrad); inputs and output gradients
  use 1x16 blocks with a random Hadamard transform on their wgrad (columnwise) usage. The
  output head and the last BF16_TAIL_FRACTION of the layers stay in bf16 (None).
  """
  from jaxquant.quantizers import NVFP4Quantizer

  first_bf16_layer = n_layers - max(1, round(BF16_TAIL_FRACTION * n_layers))
  weight_quantizer = NVFP4Quantizer(tile_2d=True)
  activation_quantizer = NVFP4Quantizer(rht=True)

  def qfactory(role):
    layer = layer_index(role.name)
    if layer is None or layer >= first_bf16_layer:
      return None
    return weight_quantizer if role.tensor_type == "weight" else activation_quantizer

  return qfactory


def model_for_recipe(plain_model: nn.Module, name: str, n_layers: int) -> nn.Module:
  """The module that trains under recipe `name`; raises early, naming what is missing."""
  if name == PLAIN_RECIPE:
    return plain_model
  try:
    from jaxquant import recipes as jaxquant_recipes
    from jaxquant.flax import quantize_model
  except ImportError as error:
    raise RuntimeError(
        f"recipe {name!r} needs jaxquant.flax.quantize_model and jaxquant.recipes, which this "
        f"jaxquant install does not provide ({error}). Run with --recipes {PLAIN_RECIPE} meanwhile."
    ) from error
  if name == CUSTOM_RECIPE:
    recipe = jaxquant_recipes.CustomRecipe(nvfp4_with_bf16_tail(n_layers))
  else:
    recipe = getattr(jaxquant_recipes, name, None)
    if recipe is None:
      raise RuntimeError(f"jaxquant.recipes has no preset named {name!r}")
  return quantize_model(plain_model, recipe)
