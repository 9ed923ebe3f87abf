"""Numerics analysis: which GEMMs of a model a recipe's formats hurt most.

- `sensitivity(model, variables, batch, recipe, loss_fn)`: every quantized role's error
  alone, at its GEMMs (SQNR of fprop, dgrad, wgrad) and at the model (loss, gradient
  norm, gradient error), ranked by module (`SensitivityReport`, `.table()`).
- `suggest_recipe(report, recipe, keep_high_precision=k, rank_by=...)`: `recipe` with the
  k most sensitive modules in bf16, ranked by their GEMMs' worst SQNR (the report's order)
  or by the model's loss change (`ranked_modules`).
- `plot_sensitivity(report, path)`: the ranking as a figure (needs matplotlib).
"""

from jaxquant.analysis._measure import (
  ModelEffect,
  ModuleSensitivity,
  RoleSensitivity,
  SensitivityReport,
  sensitivity,
)
from jaxquant.analysis._plot import plot_sensitivity
from jaxquant.analysis._suggest import (
  RANK_BY,
  KeepHighPrecision,
  RankBy,
  ranked_modules,
  suggest_recipe,
)

__all__ = [
  "RANK_BY",
  "KeepHighPrecision",
  "ModelEffect",
  "ModuleSensitivity",
  "RankBy",
  "RoleSensitivity",
  "SensitivityReport",
  "plot_sensitivity",
  "ranked_modules",
  "sensitivity",
  "suggest_recipe",
]
