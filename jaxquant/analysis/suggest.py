"""`suggest_recipe`: a recipe that keeps a report's most sensitive GEMM modules in bf16."""

from __future__ import annotations

from jaxquant import recipes


def suggest_recipe(report, recipe: recipes.CustomRecipe, *,
                   keep_high_precision: int) -> recipes.CustomRecipe:
  """`recipe`, except that the report's `keep_high_precision` top-ranked modules run in
  high precision (every role of theirs maps to None).

  Returns a `CustomRecipe` named `<recipe.name>_suggested` whose qfactory, a
  `KeepHighPrecision`, lists the kept modules as (module type, module path) in `.kept`.
  """
  if not isinstance(keep_high_precision, int) or keep_high_precision < 0:
    raise ValueError(f"suggest_recipe: keep_high_precision must be an int >= 0, got "
                     f"{keep_high_precision!r}")
  if keep_high_precision > len(report.modules):
    raise ValueError(f"suggest_recipe: keep_high_precision={keep_high_precision} but the report "
                     f"ranks only {len(report.modules)} modules")
  kept = frozenset((m.module_type, m.name) for m in report.modules[:keep_high_precision])
  return recipes.CustomRecipe(KeepHighPrecision(recipe, kept), backward=recipe.backward,
                              name=f"{recipe.name}_suggested")


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
