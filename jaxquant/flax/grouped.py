"""GroupedDense for Linen and NNX: one [G, K, N] weight parameter for all experts.

The weight carries its role (module_type "grouped_linear", tensor_type "weight", the
module path as name) through `flax.metadata` (a `QuantizedWeight` box in Linen, Param
metadata in NNX), so `metadata.weight_roles` lists it like any dense kernel. The call is
`ops.grouped_dense`. The bias, when used, is [G, N] (one per expert).

Seam: these modules take recipes without delayed scaling (per-group `RoleState`s in the
"quant_state" collection are the next step; `ops.grouped_dense` already takes
per-group state, see `init_grouped_state`); a delayed recipe raises. Stochastic rounding
draws its key from the "quant" RNG stream, like the dense layers.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from jaxquant import recipes
from jaxquant.flax.metadata import annotate_linen_weight, nnx_weight_metadata
from jaxquant.ops.grouped_dense import MODULE_TYPE, grouped_dense
from jaxquant.quantizers import needs_key, needs_state
from jaxquant.roles import QuantizerRole

QUANT_RNG = "quant"
default_kernel_init = nn.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))


def _quantizers(recipe, name, what):
  recipe = recipes.resolve(recipe)
  quantizers = recipe.quantizers(MODULE_TYPE, name)
  delayed = sorted(t for t, q in quantizers.items() if needs_state(q))
  if delayed:
    raise ValueError(f"{what}: roles {delayed} use delayed scaling, which GroupedDense does "
                     "not hold state for yet; call ops.grouped_dense with "
                     "state=init_grouped_state(...) or use a current-scaling recipe")
  return recipe, quantizers


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
    name = "/".join(self.path)
    what = f"GroupedDense {name!r}"
    recipe, quantizers = _quantizers(self.recipe, name, what)
    kernel = self.param("kernel", self.kernel_init,
                        (self.num_groups, x.shape[-1], self.features), self.param_dtype)
    annotate_linen_weight(self, "kernel", QuantizerRole(MODULE_TYPE, "weight", name),
                          quantizers["weight"])
    bias = (self.param("bias", self.bias_init, (self.num_groups, self.features), self.param_dtype)
            if self.use_bias else None)
    key = self.make_rng(QUANT_RNG) if any(map(needs_key, quantizers.values())) else None
    return grouped_dense(x, kernel, group_sizes, bias, recipe=recipe, name=name, key=key)


class NnxGroupedDense(nnx.Module):
  """NNX: the same layer; `name` names its roles (NNX modules do not know their path)."""

  def __init__(self, in_features: int, out_features: int, num_groups: int, *,
               use_bias: bool = False, recipe: Optional[recipes.CustomRecipe] = None,
               name: str = "", param_dtype=jnp.float32, kernel_init=default_kernel_init,
               rngs: nnx.Rngs):
    self.recipe, self.name = recipe, name
    _, quantizers = _quantizers(recipe, name, f"GroupedDense {name!r}")
    role = QuantizerRole(MODULE_TYPE, "weight", name)
    self.kernel = nnx.Param(kernel_init(rngs.params(), (num_groups, in_features, out_features),
                                        param_dtype),
                            **nnx_weight_metadata(role, quantizers["weight"]))
    self.bias = (nnx.Param(jnp.zeros((num_groups, out_features), param_dtype))
                 if use_bias else None)
    self.rngs = rngs if any(map(needs_key, quantizers.values())) else None

  def __call__(self, x, group_sizes):
    recipe, quantizers = _quantizers(self.recipe, self.name, f"GroupedDense {self.name!r}")
    key = None if self.rngs is None else self.rngs[QUANT_RNG]()
    bias = None if self.bias is None else self.bias[...]
    return grouped_dense(x, self.kernel[...], group_sizes, bias, recipe=recipe, name=self.name,
                         key=key)
