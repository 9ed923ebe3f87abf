"""The Flax layers the swap-in takes over, as data, and their routes (the contractions a
model's code calls are `jaxquant.intercept`'s `contraction_targets()`).

- `LINEN_LAYERS`: the Linen layers whose `__call__` the method interceptor (`_linen`) runs
  itself, each through its route, with routing paused (their GEMM is theirs).
- `NNX_LAYERS`: the NNX layers replaced, in place, by jaxquant's twin (`_nnx`), and
  `NNX_NATIVE_LAYERS`: jaxquant's own, bound to their module path and the model recipe.

Stock layers are matched by exact class: a subclass may compute something else.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
from flax import nnx

from jaxquant.flax import _grouped as grouped
from jaxquant.flax import linen
from jaxquant.flax import nnx as jq_nnx
from jaxquant.flax.swap._hooks import uses_jaxquant_hook


def _native(module, next_fun, args, kwargs, *, recipe, annotate):
  """jaxquant's own layer: the model recipe as the fallback of its own."""
  return linen.native_call(module, *args, model_recipe=recipe, **kwargs)


def _grouped(module, next_fun, args, kwargs, *, recipe, annotate):
  return grouped.linen_call(module, *args, model_recipe=recipe, **kwargs)


def _stock(module, next_fun, args, kwargs, *, recipe, annotate):
  """Flax's layer computed by `linen.gemm_call` from its own attributes and params."""
  return linen.gemm_call(module, next_fun, args, kwargs, model_recipe=recipe, annotate=annotate)


@dataclasses.dataclass(frozen=True)
class LinenLayer:
  """`classes` (exactly these with `exact`, else with subclasses) whose `__call__` runs
  as `route(module, next_fun, args, kwargs, recipe=, annotate=)`, unless `keep(module)`."""

  classes: tuple[type, ...]
  exact: bool
  route: Callable[..., Any]
  keep: Callable[[nn.Module], bool] = lambda module: False

  def matches(self, module: nn.Module) -> bool:
    if self.exact:
      found = type(module) in self.classes
    else:
      found = isinstance(module, self.classes)
    return found and not self.keep(module)


LINEN_LAYERS = (
  LinenLayer(linen.QUANTIZED_MODULES, exact=False, route=_native),
  LinenLayer((grouped.GroupedDense,), exact=False, route=_grouped),
  # A stock layer given jaxquant's dot_general_cls quantizes through that hook already.
  LinenLayer(
    (nn.Dense, nn.DenseGeneral, nn.Einsum), exact=True, route=_stock, keep=uses_jaxquant_hook
  ),
)

# Stock NNX layer -> its jaxquant twin (same constructor arguments and Params).
NNX_LAYERS = {nnx.Linear: jq_nnx.Linear, nnx.Einsum: jq_nnx.Einsum}
NNX_NATIVE_LAYERS = jq_nnx.QUANTIZED_MODULES + (grouped.NnxGroupedDense,)
