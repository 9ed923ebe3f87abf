"""Recipe names -> the jaxquant recipe, and the model each recipe trains.

This is the example's one quantization seam: 'bf16' trains the plain model; every other
name hands the plain model and a jaxquant recipe to `jaxquant.flax.quantize_model`, which
swaps its nn.Dense layers for quantized ones with the same parameters (the MoE block's
grouped projections take the recipe directly, lm/moe.py). 'custom' is a per-role policy
written here as a `CustomRecipe`: nvidia_nvfp4_policy. What the train
step must do beyond the plain model's (advance delayed-scaling state, feed stochastic
rounding a key) comes back with it in a `RecipeModel`, so training.py knows no recipe.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional

import flax.linen as nn

from jaxquant import recipes as jq_recipes
from jaxquant.flax import (
  QUANT_RNG,
  ModelWeightGather,
  QuantizedModel,
  quantize_model,
  update_quant_state,
)
from jaxquant.quantizers import Quantizer
from jaxquant.roles import QuantizerRole
from lm.model import SCANNED_LAYERS, ModelConfig

PLAIN_RECIPE = "bf16"
# Presets of jaxquant.recipes, by the same name.
PRESET_RECIPES = ("fp8_current", "fp8_delayed", "fp8_block", "mxfp8", "nvfp4", "hybrid")
# A per-role policy written here with CustomRecipe: nvidia_nvfp4_policy below.
CUSTOM_RECIPE = "custom"
RECIPE_NAMES = (PLAIN_RECIPE,) + PRESET_RECIPES + (CUSTOM_RECIPE,)
# An NVFP4 policy chosen by jaxquant.analysis on the model itself (lm/suggested.py); by
# name only ('all' is the eight above): it runs a sensitivity analysis first.
SUGGESTED_RECIPE = "suggested_nvfp4"
# The per-tensor FP8 presets with every GEMM accumulating fast (`fast_accumulation=GEMMS`),
# as XLA's FP8 dot, the peers', does; the presets accumulate fprop fast only. By name only:
# they exist to measure what the faster backward GEMMs cost in loss (docs/example.md).
FAST_ACCUMULATION_RECIPES = {"fp8_current_fast": "fp8_current", "fp8_delayed_fast": "fp8_delayed"}

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
  """'all' (RECIPE_NAMES) or a comma-separated list of names from RECIPE_NAMES,
  SUGGESTED_RECIPE and FAST_ACCUMULATION_RECIPES."""
  names = list(RECIPE_NAMES) if text == "all" else [n.strip() for n in text.split(",") if n.strip()]
  known = RECIPE_NAMES + (SUGGESTED_RECIPE,) + tuple(FAST_ACCUMULATION_RECIPES)
  unknown = [n for n in names if n not in known]
  if unknown or not names:
    raise ValueError(
      f"unknown recipe(s) {unknown or text!r}; choose from {', '.join(known)} or 'all'"
    )
  return names


def layer_index(module_path: str) -> Optional[int]:
  """3 for 'decoder/layer_3/mlp/wi'; None elsewhere (the scanned layers, the head)."""
  match = re.search(r"(?:^|/)layer_(\d+)(?:/|$)", module_path)
  return int(match.group(1)) if match else None


def in_decoder_layers(module_path: str) -> bool:
  """Whether a module belongs to a decoder layer, scanned ('decoder/layers/...') or not."""
  return layer_index(module_path) is not None or f"decoder/{SCANNED_LAYERS}/" in module_path


def bf16_tail_start(n_layers: int) -> int:
  """The first of the last BF16_TAIL_FRACTION of n_layers layers (at least one)."""
  return n_layers - max(1, round(BF16_TAIL_FRACTION * n_layers))


def nvidia_nvfp4_policy(config: ModelConfig) -> jq_recipes.CustomRecipe:
  """NVIDIA's NVFP4 pretraining recipe as a per-role policy (a CustomRecipe).

  The GEMMs of the last BF16_TAIL_FRACTION of the decoder layers (at least one) and the
  output head, which sits outside the layers, run in bf16 (None); every other role gets
  jaxquant's NVFP4 preset quantizer for it. Scanned layers share one recipe, so they must
  all lie before the bf16 tail.
  """
  first_bf16_layer = bf16_tail_start(config.n_layers)
  if config.scanned_layers > first_bf16_layer:
    raise ValueError(
      f"the custom recipe keeps layers {first_bf16_layer}.. in bf16, but "
      f"scanned_layers={config.scanned_layers} puts some of them in the scan"
    )

  def qfactory(role: QuantizerRole) -> Optional[Quantizer]:
    layer = layer_index(role.name)
    if not in_decoder_layers(role.name) or (layer is not None and layer >= first_bf16_layer):
      return None
    return jq_recipes.nvfp4_factory(role)

  return jq_recipes.CustomRecipe(qfactory, name=CUSTOM_RECIPE)


def with_bf16_head(recipe: jq_recipes.CustomRecipe) -> jq_recipes.CustomRecipe:
  """The recipe for the decoder layers; the logits head (outside them) stays in bf16.

  As in Megatron-LM and TransformerEngine, where only the transformer layers' GEMMs run in
  low precision: the head's output is the loss's input, so its quantization error goes
  straight into every gradient, and its GEMM is a small share of the step.
  """

  def qfactory(role: QuantizerRole) -> Optional[Quantizer]:
    return recipe.quantizer(role) if in_decoder_layers(role.name) else None

  # The recipe's other settings (backward, fast accumulation, tiny GEMMs) stay the preset's.
  return dataclasses.replace(recipe, qfactory=qfactory)


def recipe_for(name: str, config: ModelConfig) -> jq_recipes.CustomRecipe:
  """jaxquant's preset recipe of that name for the decoder layers (a FAST_ACCUMULATION_RECIPES
  name: its preset with every GEMM accumulating fast), or the custom policy."""
  if name == CUSTOM_RECIPE:
    return nvidia_nvfp4_policy(config)
  if name in FAST_ACCUMULATION_RECIPES:
    return with_bf16_head(every_gemm_fast(name))
  return with_bf16_head(jq_recipes.get(name))


def every_gemm_fast(name: str) -> jq_recipes.CustomRecipe:
  """The FAST_ACCUMULATION_RECIPES recipe `name`: its preset, every GEMM accumulating fast."""
  preset = jq_recipes.get(FAST_ACCUMULATION_RECIPES[name])
  return dataclasses.replace(preset, name=name, fast_accumulation=jq_recipes.GEMMS)


def preset_of(name: str) -> str:
  """The preset a recipe name stands for: itself, or a FAST_ACCUMULATION_RECIPES name's."""
  return FAST_ACCUMULATION_RECIPES.get(name, name)


def for_moe_block(recipe: jq_recipes.CustomRecipe) -> jq_recipes.CustomRecipe:
  """The recipe adapted to the MoE block (lm/moe.py): the router (a [d_model, experts]
  nn.Dense) stays in high precision, as its few logits decide where every token goes and
  its tiny output dimension does not tile into quantization blocks. The grouped expert
  projections follow the recipe (under delayed scaling, one state per expert)."""

  def qfactory(role):
    if role.name.rsplit("/", 1)[-1] == "router":
      return None
    return recipe.quantizer(role)

  return dataclasses.replace(recipe, qfactory=qfactory)


def with_quantized_gather(model: RecipeModel, mesh, param_shardings, axis: str) -> RecipeModel:
  """The model with its quantized kernels all-gathered over `axis` in their quantized form
  (quantize_model's weight_gather), given where its params are placed; the plain (bf16)
  model, which quantizes nothing, as it is."""
  if not isinstance(model.module, QuantizedModel):
    return model
  gather = ModelWeightGather(mesh, param_shardings, axis)
  return dataclasses.replace(model, module=model.module.clone(weight_gather=gather))


def model_for_recipe(plain_model: nn.Module, recipe: jq_recipes.CustomRecipe) -> RecipeModel:
  """What trains under the recipe: bf16 the plain model, the rest its quantized swap-in."""
  if recipe.name == PLAIN_RECIPE:
    return RecipeModel(plain_model, keep_forward_state, rng_streams=())
  return RecipeModel(
    quantize_model(plain_model, recipe), update_quant_state, rng_streams=(QUANT_RNG,)
  )
