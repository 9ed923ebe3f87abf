"""'suggested_nvfp4': an NVFP4 policy chosen by jaxquant.analysis for this model.

The `custom` preset keeps NVIDIA's rule-of-thumb modules in bf16 (the last layers). This
recipe keeps as many GEMM modules in bf16, but the ones the sensitivity analysis ranks
most sensitive to NVFP4 on this model, after a short bf16 training (an untrained model's
activations have none of the outliers that make some layers hard to quantize):

1. train bf16 for `TrainConfig.sensitivity_steps` steps from the first seed's parameters;
2. unroll the layers (under nn.scan all scanned layers share one role name, so the
   analysis could not tell them apart) and run `jaxquant.analysis.sensitivity` under the
   example's nvfp4 recipe on one training batch;
3. `suggest_recipe(report, nvfp4, keep_high_precision=k)`, k the number of the report's
   modules that `custom` keeps in bf16.

The policy is chosen once and trains from every seed. It names unrolled layers, so the
model it trains scans only the layers before the first kept module.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxquant import analysis
from jaxquant import recipes as jq_recipes
from lm import data, layout, recipes, training
from lm.model import ModelConfig, TransformerLM
from lm.presets import TrainConfig
from lm.recipes import SUGGESTED_RECIPE

BASE_RECIPE = "nvfp4"


@dataclasses.dataclass(frozen=True)
class Suggestion:
  recipe: jq_recipes.CustomRecipe
  report: analysis.SensitivityReport
  config: ModelConfig  # the model config it trains with (its scan layout)
  kept: tuple[str, ...]  # module paths kept in bf16, most sensitive first


def next_token_loss(call, windows: jax.Array) -> jax.Array:
  windows = windows.astype(jnp.int32)
  return training.next_token_loss(call(windows[:, :-1]), windows[:, 1:])


def briefly_trained(config: ModelConfig, params: Any, train_config: TrainConfig, batches) -> Any:
  """params after train_config.sensitivity_steps bf16 steps (the full run's schedule)."""
  model = recipes.model_for_recipe(
    TransformerLM(config), recipes.recipe_for(recipes.PLAIN_RECIPE, config)
  )
  optimizer = training.make_optimizer(train_config)
  sample = jnp.zeros((train_config.batch_size, config.seq_len), jnp.int32)
  state = training.init_train_state(model, params, jax.random.key(0), sample, optimizer)
  step = training.make_train_step(model, optimizer, deterministic=train_config.deterministic)
  for _ in range(train_config.sensitivity_steps):
    state, _ = step(state, next(batches))
  return state.params


def kept_by_custom(report: analysis.SensitivityReport, config: ModelConfig) -> int:
  """How many of the report's modules the custom preset runs wholly in bf16."""
  custom = recipes.nvidia_nvfp4_policy(config)
  return sum(
    all(custom.quantizer(r.role) is None for r in module.roles) for module in report.modules
  )


def suggest(
  config: ModelConfig,
  params: Any,
  train_config: TrainConfig,
  train_tokens,
  seed: int,
  model_runs: Optional[str] = None,
  rank_by: analysis.RankBy = "gemm_sqnr",
) -> Suggestion:
  batches = data.train_batches(train_tokens, seed, train_config.batch_size, config.seq_len)
  trained = briefly_trained(config, params, train_config, batches)
  unrolled = dataclasses.replace(config, scanned_layers=0)
  base = recipes.recipe_for(BASE_RECIPE, unrolled)
  report = analysis.sensitivity(
    TransformerLM(unrolled),
    {"params": layout.relayout(trained, config, 0)},
    jnp.asarray(next(batches)),
    base,
    next_token_loss,
    key=jax.random.key(seed),
    model_runs=model_runs,
  )
  k = kept_by_custom(report, unrolled)
  suggested = analysis.suggest_recipe(report, base, keep_high_precision=k, rank_by=rank_by)
  kept = tuple(m.name for m in analysis.ranked_modules(report, rank_by)[:k])
  first_kept_layer = min(
    (recipes.layer_index(name) for name in kept if recipes.layer_index(name) is not None),
    default=config.n_layers,
  )
  train_layout = dataclasses.replace(
    config, scanned_layers=min(config.scanned_layers, first_kept_layer)
  )
  recipe = jq_recipes.CustomRecipe(
    suggested.qfactory, backward=suggested.backward, name=SUGGESTED_RECIPE
  )
  return Suggestion(recipe, report, train_layout, kept)
