"""Swap-in: quantize the GEMMs of an ordinary Flax model without touching its code.

`quantize_model(model, recipe)`:

- Linen: returns `QuantizedModel(model, recipe)`, a wrapper that shares the model's
  scope (`nn.share_scope`, so the param tree is the model's own) and runs it under
  `nn.intercept_methods`. The interceptor redirects `__call__` of every `nn.Dense`,
  `nn.DenseGeneral` and `nn.Einsum` (exactly those classes: a subclass may compute
  something else) to `linen.gemm_call`, which uses the intercepted module's attributes
  and params. jaxquant's own Linen layers (GroupedDense included) get the model recipe
  as their fallback.
- NNX: replaces, in place, every `nnx.Linear` / `nnx.Einsum` (exactly those classes)
  reachable from the model by a jaxquant layer holding the *same* Param variables, and
  returns the model. jaxquant's own NNX layers (NnxGroupedDense included) get the model
  recipe as their fallback and their module path as role name.

Each swapped layer's roles are named by its module path; layers the recipe maps to None
run Flax's own code. With `annotate=True` the weights also carry role metadata
(`metadata.weight_roles`); off by default, since it changes the pytree structure of the
params (a box in Linen, Variable metadata in NNX) that checkpoints and optimizer states
of the plain model were made with.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn

from jaxquant import recipes
from jaxquant.flax import grouped, linen

# Exactly these classes are swapped (their subclasses may override __call__).
LINEN_GEMMS = (nn.Dense, nn.DenseGeneral, nn.Einsum)


def _linen_interceptor(recipe: Optional[recipes.CustomRecipe], annotate: bool):

  def intercept(next_fun, args, kwargs, context):
    module = context.module
    if context.method_name != "__call__":
      return next_fun(*args, **kwargs)
    if isinstance(module, linen.QUANTIZED_MODULES):
      return linen._call_native(module, *args, model_recipe=recipe, **kwargs)
    if isinstance(module, grouped.GroupedDense):
      return grouped.linen_call(module, *args, model_recipe=recipe, **kwargs)
    if type(module) in LINEN_GEMMS:
      return linen.gemm_call(module, next_fun, args, kwargs, model_recipe=recipe,
                             annotate=annotate)
    return next_fun(*args, **kwargs)

  return intercept


class QuantizedModel(nn.Module):
  """A Linen model whose Dense / DenseGeneral / Einsum GEMMs follow `recipe`.

  Same params as `module`. Only `__call__` is quantized; to quantize the GEMMs of
  another method, call it inside `intercepting(recipe)`.
  """

  module: nn.Module
  recipe: Optional[recipes.CustomRecipe] = None
  annotate: bool = False

  def setup(self):
    nn.share_scope(self, self.module)

  def __call__(self, *args, **kwargs):
    with intercepting(self.recipe, self.annotate):
      return self.module(*args, **kwargs)


def intercepting(recipe: Optional[recipes.CustomRecipe], annotate: bool = False):
  """Context in which every Linen Dense / DenseGeneral / Einsum call follows `recipe`."""
  return nn.intercept_methods(_linen_interceptor(recipe, annotate))


def quantize_model(model: Any, recipe: Optional[recipes.CustomRecipe] = None, *,
                   annotate: bool = False, rngs: Any = None) -> Any:
  """The model with its GEMMs quantized per `recipe` (None: autocast's, else bf16).

  Args:
    model: a Linen `nn.Module` (unbound) or an NNX `nnx.Module`.
    recipe: maps each role (named by module path) to a quantizer or None.
    annotate: also put role metadata on the weights (see the module docstring).
    rngs: NNX only: an `nnx.Rngs` with a "quant" stream, needed when the recipe rounds
      stochastically (Linen layers take the key from `apply(rngs={"quant": key})`).
  """
  if isinstance(model, nn.Module):
    if rngs is not None:
      raise ValueError("quantize_model: rngs= is for NNX models; a Linen model takes its "
                       "'quant' key in apply(..., rngs={'quant': key})")
    return QuantizedModel(model, recipe, annotate)
  from jaxquant.flax import nnx as jq_nnx  # NNX only for NNX models
  return jq_nnx.swap_modules(model, recipe, annotate=annotate, rngs=rngs)
