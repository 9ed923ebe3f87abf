"""GroupedDense for Linen and NNX: one [G, K, N] weight parameter for all experts.

The weight carries its role (module_type "grouped_linear", tensor_type "weight", the
module path as name) through `jaxquant.flax._metadata` (a `QuantizedWeight` box in Linen, Param
metadata in NNX), so `weight_roles` lists it like any dense kernel. The call is
`ops.grouped_dense`. The bias, when used, is [G, N] (one per expert).

The recipe resolves like the dense layers': the module's own, then the model's
(`quantize_model` passes it: `linen_call(..., model_recipe=)` from its interceptor,
`NnxGroupedDense.bind_role` in NNX), then autocast's. Under the swap-in each call is a
row of its report; as for the dense layers, a tiny GEMM runs in high precision where the
recipe keeps those there (the presets do), and a kernel whose K or N the quantizers do
not tile raises, or runs in high precision with `on_unfit="high_precision"`.

Seam: these modules take recipes without delayed scaling (per-group `RoleState`s in the
"quant_state" collection are the next step; `ops.grouped_dense` already takes
per-group state, see `init_grouped_state`); a delayed recipe raises. Stochastic rounding
draws its key from the "quant" RNG stream, like the dense layers.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxquant import recipes
from jaxquant.flax._metadata import annotate_linen_weight, nnx_weight_metadata
from jaxquant.flax._rng import linen_key, nnx_key
from jaxquant.intercept import _contraction as contraction
from jaxquant.intercept import _routing_pause as routing_pause
from jaxquant.intercept import _session as sessions
from jaxquant.intercept._keys import draws_key, without_key
from jaxquant.ops import grouped_dense
from jaxquant.ops._operands import is_high_precision
from jaxquant.quantizers import needs_state
from jaxquant.roles import GROUPED_LINEAR, QuantizerRole

default_kernel_init = nn.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))


def _quantizers(recipe, model_recipe, name, what):
  recipe = recipes.resolve(recipe, model_recipe)
  quantizers = recipe.quantizers(GROUPED_LINEAR, name)
  delayed = sorted(t for t, q in quantizers.items() if needs_state(q))
  if delayed:
    raise ValueError(
      f"{what}: roles {delayed} use delayed scaling, which GroupedDense does "
      "not hold state for yet; call ops.grouped_dense with "
      "state=init_grouped_state(...) or use a current-scaling recipe"
    )
  return recipe, quantizers


def _grouped_gemm(x, kernel, group_sizes, bias, **kwargs):
  """`_weight_gemm` in the scope of met contractions (`_session.param_contraction_scope`)."""
  with sessions.param_contraction_scope():
    return _weight_gemm(x, kernel, group_sizes, bias, **kwargs)


def _weight_gemm(x, kernel, group_sizes, bias, *, recipe, quantizers, name, path, call, key, what):
  """`ops.grouped_dense` per the quantizers, recorded in the swap-in's session if any.

  A tiny GEMM (`_contraction.tiny_reason`) runs in high precision when the recipe keeps
  such GEMMs there (every preset does). A kernel whose K or N the quantizers' blocks do
  not tile (each group's M is padded to the blocks) raises `_contraction.unfit_error`, or
  runs in high precision under a session with `on_unfit="high_precision"`. `key()` draws
  the stochastic-rounding key only for a GEMM that quantizes (None without a stream:
  `without_key`)."""
  session = sessions.current()
  record = lambda status: (
    session
    and session.record(
      sessions.Row(path, call, (np.shape(x), np.shape(kernel)), name, quantizers, status)
    )
  )
  if is_high_precision(quantizers):
    record(sessions.RECIPE_NONE)
    return grouped_dense(x, kernel, group_sizes, bias, recipe=recipe, name=name)
  _, k, n = np.shape(kernel)
  high_precision = lambda: grouped_dense(
    x, kernel, group_sizes, bias, recipe=recipes.bf16, name=name
  )
  tiny = contraction.tiny_status(k, n, quantizers, recipe)
  if tiny:
    record(tiny)
    return high_precision()
  # ops.grouped_dense checks the weight's backward usages even for a forward only.
  reason = contraction.unfit_reason(0, k, n, quantizers, backward=recipe.backward)
  if reason and (session is None or session.on_unfit == "error"):
    raise contraction.unfit_error(what, reason, name)
  if reason:
    record(sessions.unfit_status(reason))
    return high_precision()
  record(sessions.QUANTIZED)
  run = lambda operands, key: grouped_dense(*operands, recipe=recipe, name=name, key=key)
  drawn = key()
  if drawn is None:
    return without_key(run, (x, kernel, group_sizes, bias), quantizers, what)
  return run((x, kernel, group_sizes, bias), drawn)


class GroupedDense(nn.Module):
  """Linen: y[m] = x[m] @ kernel[g(m)] (+ bias[g(m)]), rows of x grouped by `group_sizes`."""

  num_groups: int
  features: int
  use_bias: bool = False
  recipe: Optional[recipes.CustomRecipe] = None
  param_dtype: jnp.dtype = jnp.float32
  kernel_init: nn.initializers.Initializer = default_kernel_init
  bias_init: nn.initializers.Initializer = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, x, group_sizes):
    return linen_call(self, x, group_sizes)


def linen_call(
  module: GroupedDense, x, group_sizes, *, model_recipe: Optional[recipes.CustomRecipe] = None
):
  """GroupedDense's computation, under the model's recipe unless the module has its own."""
  path = "/".join(module.path)
  name = path or "kernel"  # the root layer's roles by its weight's name
  what = f"GroupedDense {path!r}"
  recipe, quantizers = _quantizers(module.recipe, model_recipe, name, what)
  session = sessions.current()
  if session is not None and session.weight_gather is not None and quantizers["weight"] is not None:
    raise ValueError(
      f"{what}: quantize_model's weight_gather does not reach grouped (MoE) "
      "layers, whose experts' kernels would be gathered in high precision; "
      "leave weight_gather out"
    )
  if session is not None and session.shard_scaling is not None and quantizers["input"] is not None:
    raise ValueError(
      f"{what}: quantize_model's shard_scaling scales the rows of dense layers per "
      "shard; a grouped (MoE) layer's rows are its experts' tokens, which it does not "
      "take. Leave shard_scaling out"
    )
  kernel = module.param(
    "kernel",
    module.kernel_init,
    (module.num_groups, x.shape[-1], module.features),
    module.param_dtype,
  )
  annotate_linen_weight(
    module, "kernel", QuantizerRole(GROUPED_LINEAR, "weight", name), quantizers["weight"]
  )
  bias = (
    module.param("bias", module.bias_init, (module.num_groups, module.features), module.param_dtype)
    if module.use_bias
    else None
  )
  return _grouped_gemm(
    x,
    kernel,
    group_sizes,
    bias,
    recipe=recipe,
    quantizers=quantizers,
    name=name,
    path=path,
    call=type(module).__name__,
    key=lambda: linen_key(module, quantizers, what, optional=True),
    what=what,
  )


class NnxGroupedDense(nnx.Module):
  """NNX: the same layer; `name` names its roles (NNX modules do not know their path;
  `quantize_model` sets it to the module path)."""

  def __init__(
    self,
    in_features: int,
    out_features: int,
    num_groups: int,
    *,
    use_bias: bool = False,
    recipe: Optional[recipes.CustomRecipe] = None,
    name: str = "",
    param_dtype=jnp.float32,
    kernel_init=default_kernel_init,
    rngs: nnx.Rngs,
  ):
    self.kernel = nnx.Param(
      kernel_init(rngs.params(), (num_groups, in_features, out_features), param_dtype)
    )
    self.bias = nnx.Param(jnp.zeros((num_groups, out_features), param_dtype)) if use_bias else None
    # A preset's name becomes its recipe; what is no recipe is refused at construction.
    self.recipe = None if recipe is None else recipes.resolve(recipe)
    self.model_recipe, self.name = None, name
    quantizers = self._resolve()[1]
    # The module's own stochastic-rounding recipe draws from `rngs`; a model recipe's
    # from the rngs given to `quantize_model`.
    self.quant_rngs = nnx.data(rngs if draws_key(quantizers) else None)
    self.bind_role(name, None)

  def bind_role(self, name: str, model_recipe: Optional[recipes.CustomRecipe]) -> None:
    """Names the roles and records the model's recipe (the module's own still wins)."""
    self.name, self.model_recipe = name, model_recipe
    quantizers = self._resolve()[1]
    role = QuantizerRole(GROUPED_LINEAR, "weight", name)
    self.kernel.set_metadata(**nnx_weight_metadata(role, quantizers["weight"]))

  def _resolve(self):
    return _quantizers(self.recipe, self.model_recipe, self.name, f"GroupedDense {self.name!r}")

  def _key(self, quantizers):
    return nnx_key(
      self.quant_rngs,
      quantizers,
      f"GroupedDense {self.name!r}",
      "rngs= to quantize_model (an nnx.Rngs with a 'quant' stream)",
      optional=True,  # a forward alone may need none (`without_key`)
    )

  def __call__(self, x, group_sizes):
    with routing_pause.paused():  # under a swap-in, this layer's GEMMs are its own
      return self._call(x, group_sizes)

  def _call(self, x, group_sizes):
    recipe, quantizers = self._resolve()
    bias = None if self.bias is None else self.bias[...]
    return _grouped_gemm(
      x,
      self.kernel[...],
      group_sizes,
      bias,
      recipe=recipe,
      quantizers=quantizers,
      name=self.name,
      path=self.name,
      call=type(self).__name__,
      key=lambda: self._key(quantizers),
      what=f"GroupedDense {self.name!r}",
    )
