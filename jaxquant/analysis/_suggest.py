"""`suggest_recipe`: a recipe that keeps a report's most sensitive GEMM modules in bf16."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxquant import recipes

# What ranks the modules: the report's order (the worst SQNR of a module's GEMMs), or the
# relative change of the model's loss with only that module quantized (largest increase
# first; it needs the report's model runs, `sensitivity(..., model_runs="module")`). The
# loss change sees where an error goes (through every later layer to the loss), not only
# how large it is at its GEMM; it is a forward-pass figure, so the stochastic rounding of
# the backward pass does not blur it as it does the gradient error.
RankBy = Literal["gemm_sqnr", "loss_change"]
RANK_BY = ("gemm_sqnr", "loss_change")


def ranked_modules(report, rank_by: RankBy = "gemm_sqnr") -> tuple:
  """The report's modules, most sensitive first by `rank_by`."""
  if rank_by not in RANK_BY:
    raise ValueError(f"rank_by must be one of {RANK_BY}, got {rank_by!r}")
  if rank_by == "gemm_sqnr":
    return report.modules
  missing = [m.name for m in report.modules if m.model is None]
  if missing:
    raise ValueError(
      f"rank_by='loss_change' needs each module's model-level effect, which "
      f"{', '.join(missing)} lack: measure with sensitivity(..., "
      "model_runs='module')"
    )
  return tuple(sorted(report.modules, key=lambda m: m.model.loss_change, reverse=True))


def suggest_recipe(
  report, recipe: recipes.CustomRecipe, *, keep_high_precision: int, rank_by: RankBy = "gemm_sqnr"
) -> recipes.CustomRecipe:
  """`recipe`, except that the report's `keep_high_precision` top-ranked modules (by
  `rank_by`) run in high precision (every role of theirs maps to None).

  Returns a `CustomRecipe` named `<recipe.name>_suggested` whose qfactory, a
  `KeepHighPrecision`, lists the kept modules as (module type, module path) in `.kept`;
  its other settings (backward mode, fast accumulation, tiny GEMMs) are `recipe`'s.
  """
  if not isinstance(keep_high_precision, int) or keep_high_precision < 0:
    raise ValueError(
      f"suggest_recipe: keep_high_precision must be an int >= 0, got {keep_high_precision!r}"
    )
  if keep_high_precision > len(report.modules):
    raise ValueError(
      f"suggest_recipe: keep_high_precision={keep_high_precision} but the report "
      f"ranks only {len(report.modules)} modules"
    )
  top = ranked_modules(report, rank_by)[:keep_high_precision]
  kept = frozenset((m.module_type, m.name) for m in top)
  return dataclasses.replace(
    recipe, qfactory=KeepHighPrecision(recipe, kept), name=f"{recipe.name}_suggested"
  )


class KeepHighPrecision:
  """qfactory: None for the roles of the kept modules, `recipe`'s quantizer otherwise."""

  def __init__(self, recipe: recipes.CustomRecipe, kept: frozenset[tuple[str, str]]):
    self.recipe = recipe
    self.kept = kept

  def __call__(self, role):
    if (role.module_type, role.name) in self.kept:
      return None
    return self.recipe.quantizer(role)

  def __repr__(self):
    names = ", ".join(sorted(name for _, name in self.kept))
    return f"KeepHighPrecision({self.recipe.name!r}, kept=[{names}])"
