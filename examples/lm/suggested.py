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
model it trains scans only the layers before the first kept module. `write_policy` saves it
(POLICY_FILE, beside a run's results) and `from_policy` rebuilds it without the analysis,
so that processes of other seeds (train_seeds.py) or a later device call train the very
same policy; the analysis on another run of the same seed may, on a GPU, rank otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
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
POLICY_FILE = "suggested_policy.json"


@dataclasses.dataclass(frozen=True)
class Suggestion:
  recipe: jq_recipes.CustomRecipe
  report: Optional[analysis.SensitivityReport]  # None: rebuilt from a saved policy
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
  top = analysis.ranked_modules(report, rank_by)[:k]
  suggestion = from_policy(config, {"kept": [[m.module_type, m.name] for m in top]})
  proposed = analysis.suggest_recipe(report, base, keep_high_precision=k, rank_by=rank_by)
  if suggestion.recipe.qfactory.kept != proposed.qfactory.kept:
    raise AssertionError("the rebuilt policy keeps other modules than suggest_recipe's")
  return dataclasses.replace(suggestion, report=report)


def from_policy(config: ModelConfig, policy: dict) -> Suggestion:
  """The recipe and scan layout that keep policy["kept"] ([module type, module path] of
  the unrolled model, most sensitive first) in bf16, as analysis.suggest_recipe would."""
  kept_modules = [tuple(entry) for entry in policy["kept"]]
  kept = tuple(name for _, name in kept_modules)
  base = recipes.recipe_for(BASE_RECIPE, dataclasses.replace(config, scanned_layers=0))
  first_kept_layer = min(
    (recipes.layer_index(name) for name in kept if recipes.layer_index(name) is not None),
    default=config.n_layers,
  )
  train_layout = dataclasses.replace(
    config, scanned_layers=min(config.scanned_layers, first_kept_layer)
  )
  recipe = dataclasses.replace(
    base, qfactory=analysis.KeepHighPrecision(base, frozenset(kept_modules)), name=SUGGESTED_RECIPE
  )
  return Suggestion(recipe, None, train_layout, kept)


def policy_of(suggestion: Suggestion, seed: int, rank_by: str, sensitivity_steps: int) -> dict:
  """What write_policy saves: the kept modules and how they were chosen."""
  kept = [
    [module.module_type, module.name]
    for name in suggestion.kept
    for module in suggestion.report.modules
    if module.name == name
  ]
  return {"kept": kept, "seed": seed, "rank_by": rank_by, "sensitivity_steps": sensitivity_steps}


def write_policy(path: pathlib.Path, policy: dict) -> None:
  path.write_text(json.dumps(policy, indent=1) + "\n")


def read_policy(path: pathlib.Path, config: ModelConfig) -> dict:
  """The policy in `path` (`--suggested-policy`), checked against the model of `config`:
  an unreadable file, one that is not a policy, or one keeping a module the model does
  not have is an error naming the file and the flag."""
  where = f"--suggested-policy {path}"
  try:
    policy = json.loads(pathlib.Path(path).read_text())
  except OSError as e:
    raise ValueError(f"{where}: cannot be read ({e.strerror})") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"{where}: not a {POLICY_FILE} (not JSON: {e})") from None
  if (
    not isinstance(policy, dict)
    or not isinstance(policy.get("kept"), list)
    or not all(
      isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) for x in entry)
      for entry in policy["kept"]
    )
  ):
    raise ValueError(f"{where}: not a {POLICY_FILE} ('kept': [[module type, module path], ...])")
  modules = gemm_modules(config)
  unknown = [entry for entry in policy["kept"] if tuple(entry) not in modules]
  if unknown:
    raise ValueError(
      f"{where}: keeps modules this model ({config.n_layers} layers) does not have: "
      f"{unknown}; its GEMM modules are {sorted(list(m) for m in modules)}"
    )
  return policy


def gemm_modules(config: ModelConfig) -> set[tuple[str, str]]:
  """(module type, module path) of every GEMM module of the unrolled model, as policies
  name them: from its parameters' shapes (no compilation, no memory)."""
  unrolled = dataclasses.replace(config, scanned_layers=0)
  tokens = jax.ShapeDtypeStruct((1, config.seq_len), jnp.int32)
  shapes = jax.eval_shape(TransformerLM(unrolled).init, jax.random.key(0), tokens)
  names = [
    [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]  # not the boxes'
    for path, _ in jax.tree_util.tree_flatten_with_path(shapes["params"])[0]
  ]
  return {("linear", "/".join(keys[:-1])) for keys in names if keys[-1] == "kernel"}
