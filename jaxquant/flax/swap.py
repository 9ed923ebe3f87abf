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

Every other contraction the model's code makes (`lax.dot_general`, `jnp.einsum`,
`jnp.dot`, `jnp.matmul`, `@`) is routed (`interception`) to `routed.handle`: where one
operand is a param of the model, it is a weight GEMM named by the param's module path
(plus the param's name when that module holds several weights). Contractions of two
activations stay in high precision. `report.swap_report` lists everything met.

Each swapped layer's roles are named by its module path; layers the recipe maps to None
run Flax's own code. With `annotate=True` the weights of stock layers also carry role
metadata (`metadata.weight_roles`); off by default, since it changes the pytree
structure of the params (a box in Linen, Variable metadata in NNX) that checkpoints and
optimizer states of the plain model were made with.

No silent no-op: if a recipe that quantizes meets no weight GEMM in a call of the model,
that call raises (`session.check_found_gemms`); in Linen at the first trace (init or
apply: the wrapper is returned before any), in NNX at each call. `require_gemm=False`
silences it.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn

from jaxquant import recipes
from jaxquant.flax import grouped, interception, linen, routed
from jaxquant.flax import session as sessions
from jaxquant.flax.linen_routing import ModuleStack
from jaxquant.flax.weight_gather import ModelWeightGather

# Exactly these classes are swapped (their subclasses may override __call__).
LINEN_GEMMS = (nn.Dense, nn.DenseGeneral, nn.Einsum)


def uses_jaxquant_hook(module: nn.Module) -> bool:
  """A stock layer given jaxquant's dot_general_cls quantizes through it already."""
  from jaxquant.flax.dot_general import is_jaxquant_hook  # dot_general imports this module

  return is_jaxquant_hook(getattr(module, "dot_general_cls", None))


def _linen_interceptor(
  recipe: Optional[recipes.CustomRecipe], annotate: bool, stack: Optional[ModuleStack] = None
):

  def intercept(next_fun, args, kwargs, context):
    module = context.module
    if stack is None:
      return _dispatch(module, next_fun, args, kwargs, context.method_name)
    with stack.running(module):
      return _dispatch(module, next_fun, args, kwargs, context.method_name)

  def _dispatch(module, next_fun, args, kwargs, method_name):
    if method_name != "__call__":
      return next_fun(*args, **kwargs)
    if isinstance(module, linen.QUANTIZED_MODULES):
      with interception.paused():
        return linen._call_native(module, *args, model_recipe=recipe, **kwargs)
    if isinstance(module, grouped.GroupedDense):
      with interception.paused():
        return grouped.linen_call(module, *args, model_recipe=recipe, **kwargs)
    if type(module) in LINEN_GEMMS and not uses_jaxquant_hook(module):
      with interception.paused():
        return linen.gemm_call(
          module, next_fun, args, kwargs, model_recipe=recipe, annotate=annotate
        )
    return next_fun(*args, **kwargs)

  return intercept


class QuantizedModel(nn.Module):
  """A Linen model whose GEMMs follow `recipe`: its Dense / DenseGeneral / Einsum layers
  and every contraction its own code makes with a param operand.

  Same params as `module`. Only `__call__` is quantized; to quantize the GEMMs of
  another method, call it inside `intercepting(recipe)`. At init the model runs twice:
  first as written, so that every param exists (and each routed weight's role name sees
  all its module's weights), then quantized; the recipe is asked once per role.
  """

  module: nn.Module
  recipe: Optional[recipes.CustomRecipe] = None
  annotate: bool = False
  on_unfit: sessions.OnUnfit = "error"
  require_gemm: bool = True
  weight_gather: Optional[ModelWeightGather] = None

  def setup(self):
    nn.share_scope(self, self.module)

  def __call__(self, *args, **kwargs):
    if self.is_initializing():
      # As written (jaxquant's own layers without a recipe of their own in bf16): this
      # creates every param, and asks the recipe nothing.
      with recipes.autocast(recipes.bf16):
        self.module(*args, **kwargs)
    stack = ModuleStack()
    session = sessions.Session(
      self.recipe, self.on_unfit, stack.find_weight, weight_gather=self.weight_gather
    )
    with sessions.active(session), interception.routing(routed.handle):
      with nn.intercept_methods(_linen_interceptor(self.recipe, self.annotate, stack)):
        y = self.module(*args, **kwargs)
    if self.require_gemm:
      sessions.check_found_gemms(session, f"quantize_model({type(self.module).__name__})")
    return y


def intercepting(recipe: Optional[recipes.CustomRecipe], annotate: bool = False):
  """Context in which every Linen Dense / DenseGeneral / Einsum call follows `recipe`."""
  return nn.intercept_methods(_linen_interceptor(recipe, annotate))


def quantize_model(
  model: Any,
  recipe: Optional[recipes.CustomRecipe] = None,
  *,
  annotate: bool = False,
  rngs: Any = None,
  on_unfit: sessions.OnUnfit = "error",
  require_gemm: bool = True,
  weight_gather: Optional[ModelWeightGather] = None,
) -> Any:
  """The model with its GEMMs quantized per `recipe` (None: autocast's, else bf16).

  Args:
    model: a Linen `nn.Module` (unbound) or an NNX `nnx.Module`.
    recipe: maps each role (named by module path) to a quantizer or None.
    annotate: also put role metadata on the weights of stock layers (see the module
      docstring).
    rngs: NNX only: an `nnx.Rngs` with a "quant" stream, needed when the recipe rounds
      stochastically (Linen layers take the key from `apply(rngs={"quant": key})`).
    on_unfit: "error" (default): a GEMM whose shape a quantizer's blocks do not tile
      raises, naming the role and the dim; "high_precision": it runs in high precision
      instead, and the swap report lists it with the reason.
    require_gemm: raise when a recipe that quantizes finds no weight GEMM in the model
      (everything would silently stay in high precision); False allows it.
    weight_gather: Linen only: the params' shardings (`ModelWeightGather`); every
      quantized Dense / DenseGeneral / Einsum kernel is then quantized shard by shard and
      all-gathered in its quantized form over the FSDP axis (docs/sharding.md).
  """
  sessions.check_on_unfit(on_unfit)
  if weight_gather is not None and not isinstance(weight_gather, ModelWeightGather):
    raise TypeError(
      "quantize_model: weight_gather must be a jaxquant.flax.ModelWeightGather, "
      f"got {type(weight_gather).__name__}"
    )
  if isinstance(model, nn.Module):
    if rngs is not None:
      raise ValueError(
        "quantize_model: rngs= is for NNX models; a Linen model takes its "
        "'quant' key in apply(..., rngs={'quant': key})"
      )
    return QuantizedModel(model, recipe, annotate, on_unfit, require_gemm, weight_gather)
  if weight_gather is not None:
    raise ValueError(
      "quantize_model: weight_gather= is for Linen models; an NNX model's "
      "layers do not read their params' shardings, and would gather every "
      "weight in high precision"
    )
  from jaxquant.flax import nnx_routing  # NNX only for NNX models

  return nnx_routing.quantize_nnx_model(
    model, recipe, annotate=annotate, rngs=rngs, on_unfit=on_unfit, require_gemm=require_gemm
  )
